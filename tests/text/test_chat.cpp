// The chat layer against transformers' behaviour, through fixtures/chat/expected.json (rendered
// by make_fixtures.py with Python Jinja2): every real template on every fixed conversation, with
// and without the generation prompt; the assistant spans; instruction records; template-level
// cases with tools and dates. Then loading rules of model directories and JSONL records.
#include <gtest/gtest.h>

#include <atomic>
#include <ctime>
#include <functional>
#include <map>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "text/chat.h"
#include "text/gzip_file.h"

namespace strata::text {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

const fs::path kFixtures = fs::path(STRATA_SOURCE_DIR) / "tests/text/fixtures/chat";

const ojson& expected() {
  static const ojson j = ojson::parse(read_text_file(kFixtures / "expected.json"));
  return j;
}

const ChatTemplate& family(const std::string& name) {
  static std::map<std::string, ChatTemplate> cache;
  auto it = cache.find(name);
  if (it == cache.end()) it = cache.emplace(name, ChatTemplate::from_model_dir(kFixtures / name)).first;
  return it->second;
}

std::vector<std::pair<size_t, size_t>> spans(const ojson& j) {
  std::vector<std::pair<size_t, size_t>> out;
  for (const auto& s : j) out.emplace_back(s[0].get<size_t>(), s[1].get<size_t>());
  return out;
}

// Checks a render_conversation/render_instruct outcome against a fixture case.
void check_conversation(const ojson& c, const std::function<ChatTemplate::Rendered()>& run) {
  if (!c.contains("error")) {
    ChatTemplate::Rendered r;
    ASSERT_NO_THROW(r = run());
    EXPECT_EQ(r.text, c["text"].get<std::string>());
    EXPECT_EQ(r.trained, spans(c["trained"]));
    return;
  }
  const ojson& e = c["error"];
  const std::string kind = e["error"];
  try {
    run();
    ADD_FAILURE() << "no error; Python's rules give " << e.dump();
  } catch (const std::invalid_argument& ex) {
    const std::string what = ex.what();
    std::string want;
    if (kind == "role") want = "messages[" + std::to_string(e["index"].get<int>()) + "].role";
    else if (kind == "last") want = "does not end with an assistant turn";
    else if (kind == "empty") want = "empty conversation";
    else ADD_FAILURE() << "invalid_argument " << what << " where Python gives " << e.dump();
    EXPECT_NE(what.find(want), std::string::npos) << what;
  } catch (const jinja::Error& ex) {
    EXPECT_EQ(kind, "template") << ex.what();
    EXPECT_EQ(ex.message(), e.value("message", std::string()));
  } catch (const std::runtime_error& ex) {
    const std::string what = ex.what();
    ASSERT_TRUE(kind == "history" || kind == "template") << what << " where Python gives " << e.dump();
    ASSERT_TRUE(e.contains("turn")) << what;
    EXPECT_NE(what.find("assistant turn messages[" + std::to_string(e["turn"].get<int>()) + "]"), std::string::npos) << what;
    const std::string want = kind == "history" ? "renders history differently" : e.value("message", std::string());
    EXPECT_NE(what.find(want), std::string::npos) << what;
  }
}

TEST(ChatFixtures, CoverTheFamilies) {
  std::vector<std::string> families = expected()["families"];
  for (const char* f : {"llama3", "llama3_1", "llama3_2", "llama3_3", "qwen2_5", "qwen3", "mistral_v0_3", "mistral_nemo",
                        "gemma2", "gemma3", "phi3", "phi4", "deepseek_v3"})
    EXPECT_NE(std::find(families.begin(), families.end(), f), families.end()) << f;
}

TEST(ChatFixtures, RenderMatchesTransformers) {
  int rendered = 0, raised = 0;
  for (const auto& c : expected()["chat_cases"]) {
    const std::string fam = c["family"], conv = c["conversation"];
    const bool agp = c["add_generation_prompt"];
    if (fam == "llama3_2") continue;  // today's date: RenderWithStrftimeNow
    SCOPED_TRACE(fam + " / " + conv + (agp ? " / add_generation_prompt" : ""));
    const ojson& messages = expected()["conversations"][conv];
    if (c.contains("output")) {
      ++rendered;
      EXPECT_EQ(family(fam).render(messages, agp), c["output"].get<std::string>());
    } else {
      ++raised;
      try {
        family(fam).render(messages, agp);
        ADD_FAILURE() << "rendered; Python raises " << c["error"];
      } catch (const jinja::Error& e) {
        if (c["error_type"] == "TemplateError") {
          EXPECT_EQ(e.message(), c["error"].get<std::string>());
        }
      }
    }
  }
  EXPECT_GT(rendered, 200);
  EXPECT_GT(raised, 20);  // Gemma's "System role not supported", Mistral's alternation, ...
}

TEST(ChatFixtures, ConversationSpans) {
  int ok = 0;
  for (const auto& c : expected()["conversation_cases"]) {
    const std::string fam = c["family"], conv = c["conversation"];
    if (fam == "llama3_2") continue;
    SCOPED_TRACE(fam + " / " + conv);
    const ojson& messages = expected()["conversations"][conv];
    check_conversation(c, [&] { return family(fam).render_conversation(messages); });
    ok += !c.contains("error");
  }
  EXPECT_GT(ok, 40);
}

TEST(ChatFixtures, SpansCoverTheAssistantText) {
  // Qwen2.5, system + two turns: the spans are exactly each answer and its end marker.
  const auto r = family("qwen2_5").render_conversation(expected()["conversations"]["system_multi"]);
  ASSERT_EQ(r.trained.size(), 2u);
  EXPECT_EQ(r.text.substr(r.trained[0].first, r.trained[0].second - r.trained[0].first), "4<|im_end|>\n");
  EXPECT_EQ(r.text.substr(r.trained[1].first, r.trained[1].second - r.trained[1].first), "6<|im_end|>\n");
  EXPECT_EQ(r.trained[1].second, r.text.size());
}

TEST(ChatFixtures, Instructions) {
  for (const auto& c : expected()["instruct_cases"]) {
    const std::string fam = c["family"].is_null() ? "" : c["family"].get<std::string>();
    if (fam == "llama3_2") continue;
    SCOPED_TRACE(fam.empty() ? "no template" : fam);
    const ChatTemplate& ct = fam.empty() ? family("..") : family(fam);  // the fixtures root has no template
    ASSERT_EQ(ct.has_template(), !fam.empty());
    check_conversation(c, [&] {
      return ct.render_instruct(c["instruction"].get<std::string>(), c["input"].get<std::string>(),
                                c["output"].get<std::string>());
    });
  }
}

TEST(ChatFixtures, TemplateLevelCases) {
  for (const auto& c : expected()["template_cases"]) {
    SCOPED_TRACE(c["family"].get<std::string>() + " / " + c["name"].get<std::string>());
    const ojson config = ojson::parse(read_text_file(kFixtures / c["family"].get<std::string>() / "tokenizer_config.json"));
    const jinja::Template t = jinja::Template::parse(config["chat_template"].get<std::string>(), "chat template");
    if (c.contains("output")) {
      EXPECT_EQ(t.render(jinja::from_json(c["context"])), c["output"].get<std::string>());
    } else {
      try {
        t.render(jinja::from_json(c["context"]));
        ADD_FAILURE() << "rendered; Python raises " << c["error"];
      } catch (const jinja::Error& e) {
        EXPECT_EQ(e.message(), c["error"].get<std::string>());
      }
    }
  }
}

TEST(ChatFixtures, RenderWithStrftimeNow) {
  // Llama 3.2 dates its system prompt with strftime_now("%d %b %Y") when no date_string is given.
  const std::string out = family("llama3_2").render(expected()["conversations"]["single"], true);
  char today[64];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(today, sizeof(today), "%d %b %Y", &tm);
  EXPECT_NE(out.find(std::string("Today Date: ") + today + "\n\n"), std::string::npos) << out;
  EXPECT_EQ(out.rfind("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", 0), 0u);
}

// --- loading model directories ---

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> n{0};
    path_ = fs::temp_directory_path() / ("strata-chat-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const {
    fs::create_directories((path_ / name).parent_path());
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  fs::path path_;
};

const ojson kOneTurn = ojson::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])");

TEST(ChatTemplateLoad, NoConfigOrNoTemplate) {
  TempDir empty;
  const auto none = ChatTemplate::from_model_dir(empty.path());
  EXPECT_FALSE(none.has_template());
  EXPECT_EQ(none.bos_token(), "");
  EXPECT_THROW(none.render(kOneTurn, false), std::runtime_error);
  EXPECT_THROW(none.render_conversation(kOneTurn), std::runtime_error);

  TempDir tokens_only;
  tokens_only.write("tokenizer_config.json", R"({"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": null})");
  const auto t = ChatTemplate::from_model_dir(tokens_only.path());
  EXPECT_FALSE(t.has_template());
  EXPECT_EQ(t.bos_token(), "<s>");
  EXPECT_EQ(t.eos_token(), "");
  const auto r = t.render_instruct("Do it.", "", "Done.");  // Alpaca without a template
  EXPECT_EQ(r.text.substr(r.trained[0].first), "Done.");
}

TEST(ChatTemplateLoad, JinjaFileWinsOverConfig) {
  TempDir d;
  d.write("tokenizer_config.json", R"({"chat_template": "config", "bos_token": "<s>", "eos_token": "</s>"})");
  d.write("chat_template.jinja", "{% for m in messages %}{{ bos_token }}{{ m.content }}\r\n{% endfor %}{{ eos_token }}\n");
  EXPECT_EQ(ChatTemplate::from_model_dir(d.path()).render(kOneTurn, false), "<s>hi\n<s>yo\n</s>");
}

TEST(ChatTemplateLoad, NamedTemplates) {
  TempDir with_default;
  with_default.write("tokenizer_config.json",
                     R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
                         "eos_token": "</s>"})");
  EXPECT_EQ(ChatTemplate::from_model_dir(with_default.path()).render(kOneTurn, false), "D</s>");

  TempDir without;
  without.write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]})");
  try {
    ChatTemplate::from_model_dir(without.path());
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("none named 'default' (names: 'rag', 'tool_use')"), std::string::npos) << e.what();
  }

  TempDir files;  // additional_chat_templates replace the config's list too
  files.write("tokenizer_config.json", R"({"chat_template": "config"})");
  files.write("additional_chat_templates/tool_use.jinja", "T");
  EXPECT_THROW(ChatTemplate::from_model_dir(files.path()), std::runtime_error);
  files.write("chat_template.jinja", "F");
  EXPECT_EQ(ChatTemplate::from_model_dir(files.path()).render(kOneTurn, false), "F");
}

TEST(ChatTemplateLoad, BadFilesNameTheFile) {
  TempDir bad_json;
  bad_json.write("tokenizer_config.json", "{not json");
  try {
    ChatTemplate::from_model_dir(bad_json.path());
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: not valid JSON"), std::string::npos) << e.what();
  }
  TempDir bad_token;
  bad_token.write("tokenizer_config.json", R"({"bos_token": 5})");
  EXPECT_THROW(ChatTemplate::from_model_dir(bad_token.path()), std::runtime_error);
  TempDir bad_template;
  bad_template.write("tokenizer_config.json", R"({"chat_template": "{% if %}"})");
  EXPECT_THROW(ChatTemplate::from_model_dir(bad_template.path()), jinja::Error);
}

TEST(ChatTemplateLoad, SpecialTokensInContext) {
  TempDir d;
  d.write("tokenizer_config.json",
          R"({"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|{{ additional_special_tokens }}|{{ tools }}|{{ documents }}",
              "bos_token": "", "eos_token": "</s>", "pad_token": {"content": "<pad>"}, "unk_token": null,
              "additional_special_tokens": ["<a>", {"content": "<b>"}]})");
  // Like transformers' special_tokens_map: unset and empty tokens are not passed at all.
  EXPECT_EQ(ChatTemplate::from_model_dir(d.path()).render(kOneTurn, false), "|</s>|<pad>|False|['<a>', '<b>']|None|None");
}

TEST(ChatTemplate, FromSourceNamesErrors) {
  const auto ct = ChatTemplate::from_source("{{ bos_token }}\n{{ messages[0].content | wordwrap }}", "<s>", "</s>", "my template");
  try {
    ct.render(kOneTurn, false);
    ADD_FAILURE() << "no error";
  } catch (const jinja::Error& e) {
    EXPECT_STREQ(e.what(), "my template line 2, column 26: unsupported filter 'wordwrap'");
  }
}

TEST(ChatTemplate, ConversationValidation) {
  const auto ct = ChatTemplate::from_source("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", "", "");
  EXPECT_THROW(ct.render_conversation(ojson::array()), std::invalid_argument);
  EXPECT_THROW(ct.render_conversation(ojson::object()), std::invalid_argument);
  try {
    ct.render_conversation(ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "assistant", "content": "c"}])"));
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("messages[1].role 'tool' is not one of system, user, assistant"), std::string::npos) << e.what();
  }
  const auto r = ct.render_conversation(ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "é"}])"));
  EXPECT_EQ(r.text, "[user]a[assistant]é");
  ASSERT_EQ(r.trained.size(), 1u);
  EXPECT_EQ(r.trained[0], std::make_pair(size_t{7}, r.text.size()));  // the generation prompt adds nothing here
}

TEST(ChatTemplate, HistoryRenderedDifferentlyIsAnError) {
  // Qwen3 drops <think> from earlier turns, so the first answer renders differently later.
  const ojson conv = ojson::parse(R"([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\na1"},
                                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}])");
  try {
    family("qwen3").render_conversation(conv);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("assistant turn messages[1]: the template renders history differently"), std::string::npos)
        << e.what();
  }
}

// --- JSONL records ---

TEST(ConversationMessages, MessagesAndShareGPT) {
  const auto m = conversation_messages(nlohmann::json::parse(
      R"({"messages": [{"role": "user", "content": "hi", "name": "x"}, {"role": "assistant", "content": "yo"}], "id": 1})"));
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0]["name"], "x");  // other fields are kept
  const auto s = conversation_messages(ojson::parse(
      R"({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h"}, {"from": "gpt", "value": "g"},
                            {"from": "user", "value": "u"}, {"from": "assistant", "value": "a"}]})"));
  EXPECT_EQ(s.dump(), R"([{"role":"system","content":"s"},{"role":"user","content":"h"},{"role":"assistant","content":"g"},{"role":"user","content":"u"},{"role":"assistant","content":"a"}])");
}

TEST(ConversationMessages, ErrorsNameTheField) {
  const auto err = [](const char* record) {
    try {
      conversation_messages(nlohmann::json::parse(record));
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(err(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": 3}]})"),
            "messages[2].content is not a string");
  EXPECT_EQ(err(R"({"messages": [{"content": "a"}]})"), "messages[0].role is missing");
  EXPECT_EQ(err(R"({"messages": {}})"), "messages is not an array");
  EXPECT_EQ(err(R"({"conversations": [{"from": "bot", "value": "a"}]})"),
            "conversations[0].from 'bot' is not one of human, gpt, system, user, assistant");
  EXPECT_EQ(err(R"({"conversations": [{"from": "gpt"}]})"), "conversations[0].value is missing");
  EXPECT_EQ(err(R"({"text": "a"})"), "record has neither \"messages\" nor \"conversations\"");
  EXPECT_EQ(err(R"([1])"), "record is not a JSON object (it is array)");
}

}  // namespace
}  // namespace strata::text
