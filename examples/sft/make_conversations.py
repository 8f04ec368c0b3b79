#!/usr/bin/env python3
"""The small conversation set strata ships for its fine-tuning recipe (README "Fine-tune on
conversations", scripts/demo.sh, tests/apps/test_sft_cli.cpp): questions whose answers follow
rules a tiny byte-level model can learn in a few hundred steps (sums in words, colours of named
things, opposites). Deterministic; rerun to regenerate conversations.jsonl byte for byte."""
import json
import random

NUMS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen").split()
THINGS = {"lantern": "gold", "river": "blue", "meadow": "green", "kettle": "black", "letter": "white",
          "bridge": "grey", "orchard": "red", "harbor": "blue", "ladder": "brown", "clock": "silver"}
OPPOSITES = {"warm": "cold", "old": "new", "quiet": "loud", "narrow": "wide", "heavy": "light",
             "bright": "dark", "early": "late", "near": "far"}


def conversation(r: random.Random) -> dict:
    kind = r.randrange(3)
    if kind == 0:
        a, b = r.randrange(10), r.randrange(9)
        q, ans = f"What is {NUMS[a]} plus {NUMS[b]}?", f"{NUMS[a].capitalize()} plus {NUMS[b]} makes {NUMS[a + b]}."
    elif kind == 1:
        thing = r.choice(sorted(THINGS))
        q, ans = f"What colour is the {thing}?", f"The {thing} is {THINGS[thing]}."
    else:
        word = r.choice(sorted(OPPOSITES))
        q, ans = f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    messages = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    if r.randrange(4) == 0:  # some start with a system prompt
        messages.insert(0, {"role": "system", "content": "Answer in one short sentence."})
    return {"messages": messages}


def main() -> None:
    r = random.Random(20261205)
    with open("conversations.jsonl", "w", encoding="utf-8") as f:
        for _ in range(800):
            f.write(json.dumps(conversation(r)) + "\n")


if __name__ == "__main__":
    main()
