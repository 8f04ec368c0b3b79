// A Jinja2 interpreter for Hugging Face chat templates: the subset the Llama-3, Qwen, Mistral,
// Gemma, Phi and DeepSeek templates use, with the semantics of Python Jinja2 as transformers sets
// it up (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its own tojson,
// raise_exception, strftime_now). Whatever it does not support is an error naming the template,
// line and column; it never renders differently from Python without saying so.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::text::jinja {

// A parse or render failure: "<template name> line L, column C: <message>". message() is the part
// after the position; for raise_exception("...") it is exactly the template's own text.
class Error : public std::runtime_error {
 public:
  Error(std::string template_name, int line, int column, std::string message);
  const std::string& template_name() const { return template_name_; }
  int line() const { return line_; }      // from 1
  int column() const { return column_; }  // from 1, in characters
  const std::string& message() const { return message_; }

 private:
  std::string template_name_;
  int line_;
  int column_;
  std::string message_;
};

// Internal values that have no JSON form: namespace(), the loop variable, functions and bound
// methods, macros, generators (what select/map/reverse return). Defined in jinja_object.h.
class Object;

// A template value, with Python's semantics. Lists, dicts and strings are immutable and shared, so
// copying a Value is cheap; a namespace() object is shared and mutable, as in Python.
class Value {
 public:
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Object };
  // What a List is in Python, for printing, equality and indexing: a list, a tuple, a range, or a
  // dict_items / dict_keys / dict_values view (iterable, not indexable).
  enum class Seq : uint8_t { List, Tuple, Range, Items, Keys, Values };
  using List = std::vector<Value>;
  using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, unique keys

  Value() = default;  // undefined
  static Value undefined(std::string message);  // message: what using it says, "'x' is undefined"
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double d);
  static Value string(std::string s);
  static Value markup(std::string s);  // a string marked safe by |safe (Markup in Python)
  static Value list(List items, Seq seq = Seq::List);
  static Value tuple(List items) { return list(std::move(items), Seq::Tuple); }
  static Value dict(Dict items);  // keys must be unique (checked)
  static Value object(std::shared_ptr<Object> obj);

  Kind kind() const { return kind_; }
  Seq seq() const { return seq_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_markup() const { return markup_; }
  bool is_list() const { return kind_ == Kind::List; }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_number() const { return kind_ == Kind::Bool || kind_ == Kind::Int || kind_ == Kind::Float; }

  bool as_bool() const;      // Bool only
  int64_t as_int() const;    // Bool or Int
  double as_double() const;  // Bool, Int or Float
  const std::string& as_string() const;  // String only
  const List& as_list() const;           // List only
  const Dict& as_dict() const;           // Dict only
  Object* as_object() const;             // Object only, else nullptr
  const std::shared_ptr<Object>& object_ptr() const { return obj_; }
  const std::string& undefined_message() const;  // Undefined only

  // Dict lookup; nullptr when absent (or when this is not a dict).
  const Value* find(std::string_view key) const;

 private:
  Kind kind_ = Kind::Undefined;
  Seq seq_ = Seq::List;
  bool markup_ = false;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::shared_ptr<const std::string> str_;  // String, or the Undefined's message
  std::shared_ptr<const List> list_;
  std::shared_ptr<const Dict> dict_;
  std::shared_ptr<Object> obj_;
};

// JSON to Value; integers that fit int64 stay integers. Objects keep the order they have in `j`:
// nlohmann::json sorts keys, ordered_json keeps the source order (which Python's json.loads keeps,
// and which tojson shows).
Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);

struct Program;  // the parsed template (jinja_ast.h)

// Bounds against runaway templates (a template is data from a model directory).
struct Limits {
  size_t max_output_bytes = size_t{256} << 20;  // the rendered text
  int max_call_depth = 200;                     // nested macro calls
  int64_t max_steps = 50'000'000;               // statements and loop iterations
};
// Any one string or list a template builds is bounded too, and parsing bounds nesting.
inline constexpr size_t kMaxValueBytes = size_t{256} << 20;
inline constexpr int kMaxNestingDepth = 200;

class Template {
 public:
  // Parses `source`; throws Error (naming `name`, line and column) on a syntax error or an
  // unsupported tag.
  static Template parse(std::string_view source, std::string name);
  // Renders with `context` (a dict) as the template's variables. Throws Error on a render-time
  // failure: raise_exception, an undefined value used where Python fails, a type error, an
  // unsupported filter/test/method, or a runaway template (output, steps or recursion bounds).
  std::string render(const Value& context, const Limits& limits = {}) const;
  const std::string& name() const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace strata::text::jinja
