// libFuzzer: the Jinja interpreter (text/jinja*.cpp) on arbitrary templates. A template is data
// from a model directory, so any input must end in a rendering or a jinja::Error, never a crash,
// a hang or unbounded memory: the render runs under small limits. The context is a small chat.
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "text/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::text::jinja;
  static const Value context = from_json(nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9 {{ x }}"},
                 {"role": "assistant", "content": "<think>\nr\n</think>\n\nHello", "tool_calls": [
                   {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true, "documents": null})"));
  Limits limits;
  limits.max_output_bytes = 1 << 20;
  limits.max_steps = 100000;
  limits.max_call_depth = 50;
  try {
    const Template t = Template::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    (void)t.render(context, limits);
  } catch (const Error&) {
  }
  return 0;
}
