// Internals of the Jinja interpreter shared by its .cpp files: the Object kinds that have no JSON
// form, Python's operations on values (str(), repr(), ==, <, +, json.dumps), Unicode helpers, and
// the filters/tests/attributes the evaluator dispatches to. Not part of the public API.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja.h"

namespace strata::text::jinja {

// Thrown by value operations; the evaluator turns it into an Error at the node being evaluated.
struct EvalError {
  std::string message;
};
[[noreturn]] void fail(std::string message);
// 'text', for messages. (Written out rather than "'" + s + "'", which GCC 12 misreports under
// -Wrestrict when inlined.)
inline std::string in_quotes(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q += '\'';
  q += s;
  q += '\'';
  return q;
}

class Context;  // render state (jinja_eval.cpp)

class Object {
 public:
  virtual ~Object() = default;
  virtual std::string type_name() const = 0;  // as Python names it in messages
  // obj.name for objects that have attributes (namespace, loop); false when there is none.
  virtual bool attr(const std::string& /*name*/, Value& /*out*/) const { return false; }
  virtual bool is_callable() const { return false; }
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Binds call arguments to parameter names the way a Python signature does: positional first,
// then keywords; a missing parameter without default is an error; unknown keywords are errors.
// `defaults[i]` applies when parameter i is not given (Undefined there means "required").
std::vector<Value> bind_args(std::string_view fn_name, const CallArgs& args,
                             const std::vector<std::string_view>& params,
                             const std::vector<Value>& defaults);

// A builtin function, global or bound method.
class Function : public Object {
 public:
  using Fn = std::function<Value(Context&, const CallArgs&)>;
  Function(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string type_name() const override { return "builtin_function_or_method"; }
  bool is_callable() const override { return true; }
  const std::string& name() const { return name_; }
  Value call(Context& ctx, const CallArgs& args) const { return fn_(ctx, args); }

 private:
  std::string name_;
  Fn fn_;
};
Value make_function(std::string name, Function::Fn fn);

// namespace(): the one mutable object; `{% set ns.x = ... %}` writes here.
class Namespace : public Object {
 public:
  std::string type_name() const override { return "Namespace"; }
  bool attr(const std::string& name, Value& out) const override;
  const Value* find(std::string_view name) const;
  void set(const std::string& name, Value v);
  const Value::Dict& attrs() const { return attrs_; }

 private:
  Value::Dict attrs_;
};

// A Python generator (what select, map, unique, items and reverse return): iterating consumes it,
// it has no len() and cannot be indexed or printed.
class Generator : public Object {
 public:
  explicit Generator(std::vector<Value> items, std::string kind = "generator")
      : items_(std::move(items)), kind_(std::move(kind)) {}
  std::string type_name() const override { return kind_; }
  // The items not yet consumed; consumes them.
  std::vector<Value> take();
  // One item, or false at the end.
  bool next(Value& out);

 private:
  std::vector<Value> items_;
  size_t pos_ = 0;
  std::string kind_;
};
Value make_generator(std::vector<Value> items, std::string kind = "generator");

// --- Python semantics of values (jinja_value.cpp) ---
std::string type_name(const Value& v);    // "str", "int", "list", "dict", "NoneType", ...
std::string object_type_repr(const Value& v);  // Jinja's: "None", "dict object", ...
std::string to_str(const Value& v);       // str(v); str(Undefined) is ""
std::string repr(const Value& v);         // repr(v)
std::string repr_string(std::string_view s);
std::string float_repr(double d);
bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);  // ==
bool less(const Value& a, const Value& b);    // <, TypeError when unordered
[[noreturn]] void fail_undefined(const Value& v);  // UndefinedError with v's message
// Items of anything Python can iterate (str: characters, dict: keys, generator: consumed);
// TypeError otherwise. Undefined iterates as empty.
std::vector<Value> iterate(const Value& v);
// len(); TypeError for what has none.
int64_t length(const Value& v);
// json.dumps(v, ensure_ascii, indent, separators, sort_keys). indent: "" and !has_indent = None.
struct JsonStyle {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};
std::string json_dumps(const Value& v, const JsonStyle& style);

// --- arithmetic and operators (jinja_value.cpp) ---
enum class BinOp { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };
Value binary_op(BinOp op, const Value& a, const Value& b);
Value negate(const Value& v);
Value unary_plus(const Value& v);
bool contains(const Value& container, const Value& item);  // Python `item in container`
// Fails as hash() does for a list, dict or view (or a tuple holding one); namespaces and
// functions hash by identity.
void check_hashable(const Value& v);
Value make_string_checked(std::string s);  // fails when s exceeds kMaxValueBytes
Value make_list_checked(Value::List items, Value::Seq seq = Value::Seq::List);

// --- Unicode (jinja_unicode.cpp) ---
std::vector<char32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<char32_t>& cps, size_t begin = 0, size_t end = SIZE_MAX);
void utf8_append(std::string& out, char32_t c);
size_t utf8_length(std::string_view s);
bool utf8_valid(std::string_view s);
bool py_isspace(char32_t c);
bool py_isprintable(char32_t c);
std::string py_upper(std::string_view s);
std::string py_lower(std::string_view s);
std::string py_title(std::string_view s);       // str.title()
std::string py_capitalize(std::string_view s);  // str.capitalize()
std::string py_strip(std::string_view s, const Value& chars, bool left, bool right);
bool py_isdigit(char32_t c);
bool py_isdecimal(char32_t c);
bool py_isnumeric(char32_t c);
bool py_isalpha(char32_t c);
bool py_islower_cp(char32_t c);  // Lowercase property
bool py_isupper_cp(char32_t c);  // Uppercase property
bool py_istitle_cp(char32_t c);
std::vector<std::string> py_splitlines(std::string_view s, bool keepends);

// --- attributes, items, filters, tests, globals (jinja_builtins.cpp, jinja_strings.cpp) ---
Value get_attr(const Value& obj, const std::string& name);  // environment.getattr (sandboxed)
Value get_item(const Value& obj, const Value& key);         // environment.getitem (sandboxed)
Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
// A str method bound to `s`, or Undefined when str has no such attribute; fails for a Python str
// method this interpreter does not implement.
Value string_method(const Value& s, const std::string& name);
Value call_filter(Context& ctx, const std::string& name, const Value& value, const CallArgs& args);
bool call_test(Context& ctx, const std::string& name, const Value& value, const CallArgs& args);
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
Value global_function(std::string_view name);  // Undefined when no such global
// Python str.format with the sandbox's formatter (auto/explicit/named fields, !r/!s).
std::string py_format(const std::string& fmt, const CallArgs& args);

// Calls a callable Value (Function, or a Macro via the evaluator). Defined in jinja_eval.cpp.
Value call_value(Context& ctx, const Value& callee, const CallArgs& args);
// The current time formatted by strftime, for the strftime_now global.
std::string strftime_now(const std::string& format);

}  // namespace strata::text::jinja
