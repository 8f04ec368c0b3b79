// Chat templates as transformers applies them: loading a model directory's template and special
// tokens, rendering a conversation, and finding the byte spans of assistant turns to train on
// (and the Alpaca prompt for instruction data without a template).
#pragma once
#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace strata::text {

class ChatTemplate {
 public:
  // Reads DIR/tokenizer_config.json: chat_template is a string, or a list of {"name","template"}
  // (the one named "default" is used; none named so is an error listing the names). As in
  // transformers >= 4.47, DIR/chat_template.jinja (and DIR/additional_chat_templates/*.jinja)
  // replace the config's templates when present. bos_token/eos_token (and the other special
  // tokens) are strings, {"content": ...} objects, or null. No config and no template file, or no
  // template: has_template() is false, which is an error only when rendering is asked for.
  // Throws std::runtime_error naming the file on unreadable or malformed input, and jinja::Error
  // when the template does not parse.
  static ChatTemplate from_model_dir(const std::filesystem::path& dir);
  static ChatTemplate from_source(std::string source, std::string bos_token, std::string eos_token,
                                  std::string name = "chat template");

  bool has_template() const { return tmpl_.has_value(); }
  const std::string& bos_token() const { return bos_; }  // "" when the config has none
  const std::string& eos_token() const { return eos_; }

  // The template rendered with the variables transformers' apply_chat_template passes: the set
  // special tokens (bos/eos/unk/sep/pad/cls/mask_token, additional_special_tokens), messages,
  // tools=None, documents=None, add_generation_prompt. nlohmann::json sorts object keys; pass an
  // ordered_json to keep the order tojson shows (Python keeps it).
  std::string render(const nlohmann::json& messages, bool add_generation_prompt) const;
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const;

  struct Rendered {
    std::string text;
    std::vector<std::pair<size_t, size_t>> trained;  // byte spans [begin, end) of text to train on
  };

  // All messages rendered (add_generation_prompt=false). For each assistant message i, the trained
  // span is the bytes between the rendering of messages[:i] with add_generation_prompt=true and of
  // messages[:i+1] without, when both are prefixes of the whole text. A template that renders
  // history differently from the last turn (Qwen3 drops earlier thinking, Mistral moves the system
  // message, Phi-3 appends EOS) breaks that; then the answer's text (as given, else trimmed) is
  // found in the whole text after the previous span, and the span runs from the end of the
  // generation prompt (when that is a prefix before the answer) or the answer, through the
  // end-of-turn text that follows the answer in both renderings. An answer found nowhere throws
  // naming the turn. Roles: system, user, assistant, and tool when the template mentions a 'tool'
  // role. An unknown role, an empty conversation or one not ending with an assistant turn throws
  // std::invalid_argument.
  Rendered render_conversation(const nlohmann::json& messages) const;
  Rendered render_conversation(const nlohmann::ordered_json& messages) const;

  // An Alpaca-style record. With a template: [user: instruction (+ "\n\n" + input when input is not
  // empty), assistant: output] through render_conversation. Without: the standard Alpaca prompt
  // (with or without the "### Input:" section, ending "### Response:\n") followed by output; the
  // trained span is output (the caller appends EOS).
  Rendered render_instruct(std::string_view instruction, std::string_view input, std::string_view output) const;

 private:
  std::string render_value(const jinja::Value& messages, bool add_generation_prompt) const;
  Rendered conversation(const jinja::Value& messages) const;

  std::optional<jinja::Template> tmpl_;
  bool takes_tool_role_ = false;
  std::string bos_, eos_;
  jinja::Value::Dict special_tokens_;  // what the context gets: the set special tokens
};

// A JSONL record to messages: {"messages": [{"role", "content"}, ...]} (kept as given, other
// fields included) or ShareGPT {"conversations": [{"from", "value"}, ...]} (from: human -> user,
// gpt -> assistant, system -> system; user and assistant as themselves). Throws
// std::invalid_argument naming the missing or bad field ("messages[2].content is not a string").
nlohmann::json conversation_messages(const nlohmann::json& record);
nlohmann::ordered_json conversation_messages(const nlohmann::ordered_json& record);

}  // namespace strata::text
