// Chat templates the way transformers loads and applies them (tokenization_utils_base.py:
// from_pretrained's template files, special_tokens_map, apply_chat_template), and the assistant
// spans a trainer masks the loss with. See chat.h for the rules.
#include "text/chat.h"

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace strata::text {

namespace {

using jinja::Value;

const char* const kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                      "pad_token", "cls_token", "mask_token"};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw std::runtime_error("cannot read " + path.string());
  return ss.str();
}

// Python's text mode (universal newlines), as transformers reads chat_template.jinja.
std::string universal_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// A special token's text: a string, an AddedToken {"content": ...}, or null (nullopt).
std::optional<std::string> token_text(const nlohmann::ordered_json& v, const std::string& field, const std::filesystem::path& file) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  throw std::runtime_error(file.string() + ": " + field + " is neither a string, an object with a string \"content\", nor null");
}

bool mentions_tool_role(const std::string& source) {
  return source.find("'tool'") != std::string::npos || source.find("\"tool\"") != std::string::npos;
}

template <class Json>
std::string describe_type(const Json& j) {
  return j.type_name();
}

// m is an object whose fields a and b are strings; else an error naming "<at>.<field>".
template <class Json>
void require_strings(const Json& m, const std::string& at, const char* a, const char* b) {
  if (!m.is_object()) throw std::invalid_argument(at + " is not an object");
  for (const char* key : {a, b}) {
    if (!m.contains(key)) throw std::invalid_argument(at + "." + key + " is missing");
    if (!m[key].is_string()) throw std::invalid_argument(at + "." + key + " is not a string");
  }
}

template <class Json>
Json messages_of(const Json& record) {
  if (!record.is_object()) throw std::invalid_argument("record is not a JSON object (it is " + describe_type(record) + ")");
  if (record.contains("messages")) {
    const Json& msgs = record["messages"];
    if (!msgs.is_array()) throw std::invalid_argument("messages is not an array");
    for (size_t i = 0; i < msgs.size(); ++i) {
      const std::string at = "messages[" + std::to_string(i) + "]";
      const Json& m = msgs[i];
      require_strings(m, at, "role", "content");
    }
    return msgs;
  }
  if (record.contains("conversations")) {
    const Json& conv = record["conversations"];
    if (!conv.is_array()) throw std::invalid_argument("conversations is not an array");
    Json out = Json::array();
    for (size_t i = 0; i < conv.size(); ++i) {
      const std::string at = "conversations[" + std::to_string(i) + "]";
      const Json& m = conv[i];
      require_strings(m, at, "from", "value");
      const std::string from = m["from"].template get<std::string>();
      std::string role;
      if (from == "human" || from == "user") role = "user";
      else if (from == "gpt" || from == "assistant") role = "assistant";
      else if (from == "system") role = "system";
      else throw std::invalid_argument(at + ".from '" + from + "' is not one of human, gpt, system, user, assistant");
      Json msg = Json::object();
      msg["role"] = role;
      msg["content"] = m["value"];
      out.push_back(std::move(msg));
    }
    return out;
  }
  throw std::invalid_argument("record has neither \"messages\" nor \"conversations\"");
}

}  // namespace

ChatTemplate ChatTemplate::from_model_dir(const std::filesystem::path& dir) {
  ChatTemplate ct;
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  std::map<std::string, std::string> templates;  // name -> source
  std::filesystem::path template_origin = config_path;
  if (std::filesystem::exists(config_path)) {
    nlohmann::ordered_json config;
    try {
      config = nlohmann::ordered_json::parse(read_file(config_path));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(config_path.string() + ": not valid JSON: " + e.what());
    }
    if (!config.is_object()) throw std::runtime_error(config_path.string() + ": not a JSON object");
    for (const char* name : kSpecialTokens) {
      if (!config.contains(name)) continue;
      const auto text = token_text(config[name], name, config_path);
      if (std::string_view(name) == "bos_token") ct.bos_ = text.value_or("");
      if (std::string_view(name) == "eos_token") ct.eos_ = text.value_or("");
      if (text && !text->empty()) ct.special_tokens_.emplace_back(name, Value::string(*text));
    }
    if (config.contains("additional_special_tokens") && !config["additional_special_tokens"].is_null()) {
      const auto& extra = config["additional_special_tokens"];
      if (!extra.is_array()) throw std::runtime_error(config_path.string() + ": additional_special_tokens is not a list");
      Value::List items;
      for (size_t i = 0; i < extra.size(); ++i) {
        const auto text = token_text(extra[i], "additional_special_tokens[" + std::to_string(i) + "]", config_path);
        if (text) items.push_back(Value::string(*text));
      }
      if (!items.empty()) ct.special_tokens_.emplace_back("additional_special_tokens", Value::list(std::move(items)));
    }
    if (config.contains("chat_template") && !config["chat_template"].is_null()) {
      const auto& t = config["chat_template"];
      if (t.is_string()) {
        templates["default"] = t.get<std::string>();
      } else if (t.is_array()) {
        for (size_t i = 0; i < t.size(); ++i) {
          const auto& e = t[i];
          if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") || !e["template"].is_string())
            throw std::runtime_error(config_path.string() + ": chat_template[" + std::to_string(i) +
                                     "] is not an object with string \"name\" and \"template\"");
          templates[e["name"].get<std::string>()] = e["template"].get<std::string>();
        }
      } else {
        throw std::runtime_error(config_path.string() + ": chat_template is neither a string nor a list of {\"name\", \"template\"}");
      }
    }
  }
  // Template files take priority over the config's entries, all of them (transformers >= 4.47).
  std::map<std::string, std::string> file_templates;
  const std::filesystem::path jinja_path = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja_path)) file_templates["default"] = universal_newlines(read_file(jinja_path));
  const std::filesystem::path extra_dir = dir / "additional_chat_templates";
  if (std::filesystem::is_directory(extra_dir)) {
    for (const auto& entry : std::filesystem::directory_iterator(extra_dir))
      if (entry.is_regular_file() && entry.path().extension() == ".jinja")
        file_templates[entry.path().stem().string()] = universal_newlines(read_file(entry.path()));
  }
  if (!file_templates.empty()) {
    templates = std::move(file_templates);
    template_origin = jinja_path;
  }
  if (templates.empty()) return ct;
  const auto it = templates.find("default");
  if (it == templates.end()) {
    std::string names;
    for (const auto& [name, src] : templates) names += (names.empty() ? "'" : ", '") + name + "'";
    throw std::runtime_error(template_origin.string() + ": several chat templates and none named 'default' (names: " + names + ")");
  }
  ct.takes_tool_role_ = mentions_tool_role(it->second);
  ct.tmpl_ = jinja::Template::parse(it->second, "chat template");
  return ct;
}

ChatTemplate ChatTemplate::from_source(std::string source, std::string bos_token, std::string eos_token, std::string name) {
  ChatTemplate ct;
  ct.bos_ = std::move(bos_token);
  ct.eos_ = std::move(eos_token);
  if (!ct.bos_.empty()) ct.special_tokens_.emplace_back("bos_token", Value::string(ct.bos_));
  if (!ct.eos_.empty()) ct.special_tokens_.emplace_back("eos_token", Value::string(ct.eos_));
  ct.takes_tool_role_ = mentions_tool_role(source);
  ct.tmpl_ = jinja::Template::parse(source, std::move(name));
  return ct;
}

std::string ChatTemplate::render_value(const Value& messages, bool add_generation_prompt) const {
  if (!tmpl_) throw std::runtime_error("this model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja)");
  Value::Dict context = special_tokens_;
  const auto put = [&](const std::string& k, Value v) {
    for (auto& [ek, ev] : context)
      if (ek == k) {
        ev = std::move(v);
        return;
      }
    context.emplace_back(k, std::move(v));
  };
  put("messages", messages);
  put("tools", Value::none());
  put("documents", Value::none());
  put("add_generation_prompt", Value::boolean(add_generation_prompt));
  return tmpl_->render(Value::dict(std::move(context)));
}

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt) const {
  return render_value(jinja::from_json(messages), add_generation_prompt);
}
std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt) const {
  return render_value(jinja::from_json(messages), add_generation_prompt);
}

ChatTemplate::Rendered ChatTemplate::conversation(const Value& messages) const {
  if (!tmpl_) throw std::runtime_error("this model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja)");
  if (!messages.is_list()) throw std::invalid_argument("messages is not a list");
  const Value::List& msgs = messages.as_list();
  if (msgs.empty()) throw std::invalid_argument("empty conversation: no messages");
  std::string allowed = takes_tool_role_ ? "system, user, assistant, tool" : "system, user, assistant";
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!msgs[i].is_dict()) throw std::invalid_argument(at + " is not an object");
    const Value* role = msgs[i].find("role");
    if (!role || !role->is_string()) throw std::invalid_argument(at + ".role is missing or not a string");
    const std::string& r = role->as_string();
    if (r != "system" && r != "user" && r != "assistant" && !(r == "tool" && takes_tool_role_))
      throw std::invalid_argument(at + ".role '" + r + "' is not one of " + allowed +
                                  (r == "tool" ? " (the template has no 'tool' role)" : ""));
  }
  const std::string& last_role = msgs.back().find("role")->as_string();
  if (last_role != "assistant")
    throw std::invalid_argument("conversation does not end with an assistant turn: messages[" + std::to_string(msgs.size() - 1) +
                                "] is '" + last_role + "'");
  Rendered out;
  out.text = render_value(messages, false);
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i].find("role")->as_string() != "assistant") continue;
    const Value before_msgs = Value::list(Value::List(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(i)));
    const Value upto_msgs = Value::list(Value::List(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(i) + 1));
    std::string before, upto;
    try {
      before = render_value(before_msgs, true);
      // messages[:i+1] of the last message is the whole conversation, already rendered
      upto = i + 1 == msgs.size() ? out.text : render_value(upto_msgs, false);
    } catch (const jinja::Error& e) {
      throw std::runtime_error("assistant turn messages[" + std::to_string(i) + "]: rendering the conversation up to it failed: " + e.what());
    }
    const size_t search_from = out.trained.empty() ? 0 : out.trained.back().second;
    const bool before_is_prefix = out.text.compare(0, before.size(), before) == 0;
    if (before_is_prefix && out.text.compare(0, upto.size(), upto) == 0 && upto.size() >= before.size() &&
        before.size() >= search_from) {
      out.trained.emplace_back(before.size(), upto.size());
      continue;
    }
    // The template renders history differently from the last turn (Qwen3 drops earlier thinking,
    // Mistral moves the system message to the last user turn, Phi-3 appends EOS): the answer's
    // text is found in the whole rendering (as given, else trimmed), and the span runs from the
    // end of the generation prompt (when that is a prefix and comes before the answer) or the
    // answer, through the end-of-turn text that follows the answer both in the turn's own
    // rendering and in the whole one.
    std::optional<std::pair<size_t, size_t>> span;
    const Value* content = msgs[i].find("content");
    if (content && content->is_string()) {
      const std::string& full_content = content->as_string();
      const size_t a = full_content.find_first_not_of(" \t\n\r\f\v");
      const size_t z = full_content.find_last_not_of(" \t\n\r\f\v");
      const std::string trimmed = a == std::string::npos ? std::string() : full_content.substr(a, z - a + 1);
      for (const std::string* c : {&full_content, &trimmed}) {
        if (c->empty()) continue;
        const size_t p = out.text.find(*c, search_from);
        if (p == std::string::npos) continue;
        const size_t q = upto.rfind(*c);
        const std::string_view suffix = q == std::string::npos ? std::string_view() : std::string_view(upto).substr(q + c->size());
        const std::string_view rest = std::string_view(out.text).substr(p + c->size());
        size_t k = 0;
        while (k < suffix.size() && k < rest.size() && suffix[k] == rest[k]) ++k;
        while (k > 0 && k < rest.size() && (static_cast<unsigned char>(rest[k]) & 0xC0) == 0x80) --k;  // whole characters
        const size_t start = before_is_prefix && search_from <= before.size() && before.size() <= p ? before.size() : p;
        span = std::make_pair(start, p + c->size() + k);
        break;
      }
    }
    if (!span)
      throw std::runtime_error("assistant turn messages[" + std::to_string(i) +
                               "]: the template renders history differently from the turn itself (the rendering of "
                               "messages[:" + std::to_string(i) + "] with add_generation_prompt=true or of messages[:" +
                               std::to_string(i + 1) + "] is not a prefix of the whole conversation), and the answer's "
                               "text is not in the whole rendering either, so its trained span is undefined");
    out.trained.push_back(*span);
  }
  return out;
}

ChatTemplate::Rendered ChatTemplate::render_conversation(const nlohmann::json& messages) const {
  if (!messages.is_array()) throw std::invalid_argument("messages is not a JSON array");
  return conversation(jinja::from_json(messages));
}
ChatTemplate::Rendered ChatTemplate::render_conversation(const nlohmann::ordered_json& messages) const {
  if (!messages.is_array()) throw std::invalid_argument("messages is not a JSON array");
  return conversation(jinja::from_json(messages));
}

ChatTemplate::Rendered ChatTemplate::render_instruct(std::string_view instruction, std::string_view input,
                                                     std::string_view output) const {
  if (tmpl_) {
    std::string user(instruction);
    if (!input.empty()) {
      user += "\n\n";
      user += input;
    }
    Value::List msgs;
    msgs.push_back(Value::dict({{"role", Value::string("user")}, {"content", Value::string(std::move(user))}}));
    msgs.push_back(Value::dict({{"role", Value::string("assistant")}, {"content", Value::string(std::string(output))}}));
    return conversation(Value::list(std::move(msgs)));
  }
  Rendered out;
  if (input.empty()) {
    out.text = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n";
    out.text += instruction;
  } else {
    out.text =
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
        "response that appropriately completes the request.\n\n### Instruction:\n";
    out.text += instruction;
    out.text += "\n\n### Input:\n";
    out.text += input;
  }
  out.text += "\n\n### Response:\n";
  const size_t begin = out.text.size();
  out.text += output;
  out.trained.emplace_back(begin, out.text.size());
  return out;
}

nlohmann::json conversation_messages(const nlohmann::json& record) { return messages_of(record); }
nlohmann::ordered_json conversation_messages(const nlohmann::ordered_json& record) { return messages_of(record); }

}  // namespace strata::text
