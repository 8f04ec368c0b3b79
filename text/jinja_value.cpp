// Values and Python's operations on them: str() and repr(), truthiness, ==, <, len(), iteration,
// the arithmetic operators, `in`, and json.dumps (transformers' tojson). Every TypeError Python
// would raise is an EvalError here, so a template never renders what Python would refuse.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <nlohmann/json.hpp>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

namespace {
constexpr int kMaxValueDepth = 500;  // nesting of lists/dicts for repr, ==, json.dumps
}

Error::Error(std::string template_name, int line, int column, std::string message)
    : std::runtime_error(template_name + " line " + std::to_string(line) + ", column " +
                         std::to_string(column) + ": " + message),
      template_name_(std::move(template_name)),
      line_(line),
      column_(column),
      message_(std::move(message)) {}

void fail(std::string message) { throw EvalError{std::move(message)}; }

// --- Value ---

Value Value::undefined(std::string message) {
  Value v;
  v.str_ = std::make_shared<const std::string>(std::move(message));
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::Bool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::Int;
  v.i_ = i;
  return v;
}
Value Value::number(double d) {
  Value v;
  v.kind_ = Kind::Float;
  v.f_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::String;
  v.str_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::markup(std::string s) {
  Value v = string(std::move(s));
  v.markup_ = true;
  return v;
}
Value Value::list(List items, Seq seq) {
  Value v;
  v.kind_ = Kind::List;
  v.seq_ = seq;
  v.list_ = std::make_shared<const List>(std::move(items));
  return v;
}
Value Value::dict(Dict items) {
  std::unordered_set<std::string_view> seen;
  seen.reserve(items.size());
  for (const auto& kv : items)
    if (!seen.insert(kv.first).second) throw std::invalid_argument("duplicate dict key " + in_quotes(kv.first));
  Value v;
  v.kind_ = Kind::Dict;
  v.dict_ = std::make_shared<const Dict>(std::move(items));
  return v;
}
Value Value::object(std::shared_ptr<Object> obj) {
  Value v;
  v.kind_ = Kind::Object;
  v.obj_ = std::move(obj);
  return v;
}

bool Value::as_bool() const { return b_; }
int64_t Value::as_int() const { return kind_ == Kind::Bool ? int64_t{b_} : i_; }
double Value::as_double() const {
  if (kind_ == Kind::Float) return f_;
  return static_cast<double>(as_int());
}
const std::string& Value::as_string() const { return *str_; }
const Value::List& Value::as_list() const { return *list_; }
const Value::Dict& Value::as_dict() const { return *dict_; }
Object* Value::as_object() const { return kind_ == Kind::Object ? obj_.get() : nullptr; }
const std::string& Value::undefined_message() const {
  static const std::string kDefault = "value is undefined";
  return str_ ? *str_ : kDefault;
}
const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::Dict) return nullptr;
  for (const auto& [k, v] : *dict_)
    if (k == key) return &v;
  return nullptr;
}

namespace {

template <class Json>
Value from_json_impl(const Json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::none();
    case nlohmann::json::value_t::boolean:
      return Value::boolean(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::integer(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw std::invalid_argument("integer " + std::to_string(u) + " does not fit in 64 bits");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::number(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::string(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      Value::List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_impl(e));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Value::Dict items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(it.key(), from_json_impl(it.value()));
      return Value::dict(std::move(items));
    }
    default:
      throw std::invalid_argument("JSON value of type " + std::string(j.type_name()) + " has no template value");
  }
}

}  // namespace

Value from_json(const nlohmann::json& j) { return from_json_impl(j); }
Value from_json(const nlohmann::ordered_json& j) { return from_json_impl(j); }

// --- objects ---

const Value* Namespace::find(std::string_view name) const {
  for (const auto& [k, v] : attrs_)
    if (k == name) return &v;
  return nullptr;
}
bool Namespace::attr(const std::string& name, Value& out) const {
  const Value* v = find(name);
  if (v) out = *v;
  return v != nullptr;
}
void Namespace::set(const std::string& name, Value v) {
  for (auto& [k, old] : attrs_)
    if (k == name) {
      old = std::move(v);
      return;
    }
  attrs_.emplace_back(name, std::move(v));
}

std::vector<Value> Generator::take() {
  std::vector<Value> rest(items_.begin() + static_cast<std::ptrdiff_t>(pos_), items_.end());
  pos_ = items_.size();
  return rest;
}
bool Generator::next(Value& out) {
  if (pos_ >= items_.size()) return false;
  out = items_[pos_++];
  return true;
}

Value make_function(std::string name, Function::Fn fn) {
  return Value::object(std::make_shared<Function>(std::move(name), std::move(fn)));
}
Value make_generator(std::vector<Value> items, std::string kind) {
  return Value::object(std::make_shared<Generator>(std::move(items), std::move(kind)));
}

Value make_string_checked(std::string s) {
  if (s.size() > kMaxValueBytes) fail("string of " + std::to_string(s.size()) + " bytes exceeds the limit of " + std::to_string(kMaxValueBytes));
  return Value::string(std::move(s));
}
Value make_list_checked(Value::List items, Value::Seq seq) {
  if (items.size() * sizeof(Value) > kMaxValueBytes) fail("list of " + std::to_string(items.size()) + " items exceeds the size limit");
  return Value::list(std::move(items), seq);
}

// --- names of types ---

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return "Undefined";
    case Value::Kind::None: return "NoneType";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::Int: return "int";
    case Value::Kind::Float: return "float";
    case Value::Kind::String: return v.is_markup() ? "Markup" : "str";
    case Value::Kind::Dict: return "dict";
    case Value::Kind::Object: return v.as_object()->type_name();
    case Value::Kind::List:
      switch (v.seq()) {
        case Value::Seq::List: return "list";
        case Value::Seq::Tuple: return "tuple";
        case Value::Seq::Range: return "range";
        case Value::Seq::Items: return "dict_items";
        case Value::Seq::Keys: return "dict_keys";
        case Value::Seq::Values: return "dict_values";
      }
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.kind() == Value::Kind::Object || v.is_markup()) return "jinja2." + type_name(v) + " object";
  return type_name(v) + " object";
}

void fail_undefined(const Value& v) { fail(v.undefined_message()); }

// --- str() and repr() ---

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // -d.ddde[+-]XX
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t epos = sci.find('e');
  std::string digits = sci.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(epos + 1));
  const int decpt = exp10 + 1;  // digits are 0.DIGITS * 10^decpt
  const int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt > -4 && decpt <= 16) {  // CPython's repr: fixed notation in this range
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out = digits + std::string(static_cast<size_t>(decpt - n), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int e = decpt - 1;
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", e < 0 ? '-' : '+', std::abs(e));
    out += ebuf;
  }
  return sign + out;
}

std::string repr_string(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else if (c < 0x7F || py_isprintable(c)) {
      utf8_append(out, c);
    } else if (c <= 0xFF) {
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else if (c <= 0xFFFF) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    }
  }
  out.push_back(quote);
  return out;
}

namespace {

void repr_into(std::string& out, const Value& v, int depth);

void repr_items(std::string& out, const Value::List& items, int depth) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    repr_into(out, items[i], depth + 1);
  }
}

void repr_into(std::string& out, const Value& v, int depth) {
  if (depth > kMaxValueDepth) fail("value nested too deeply to print");
  switch (v.kind()) {
    case Value::Kind::Undefined: out += "Undefined"; return;
    case Value::Kind::String:
      if (v.is_markup()) {
        out += "Markup(" + repr_string(v.as_string()) + ")";
      } else {
        out += repr_string(v.as_string());
      }
      return;
    case Value::Kind::List:
      switch (v.seq()) {
        case Value::Seq::List: out += "["; repr_items(out, v.as_list(), depth); out += "]"; return;
        case Value::Seq::Tuple:
          out += "(";
          repr_items(out, v.as_list(), depth);
          out += v.as_list().size() == 1 ? ",)" : ")";
          return;
        case Value::Seq::Range: fail("unsupported: printing a range object");
        case Value::Seq::Items: out += "dict_items(["; repr_items(out, v.as_list(), depth); out += "])"; return;
        case Value::Seq::Keys: out += "dict_keys(["; repr_items(out, v.as_list(), depth); out += "])"; return;
        case Value::Seq::Values: out += "dict_values(["; repr_items(out, v.as_list(), depth); out += "])"; return;
      }
      return;
    case Value::Kind::Dict: {
      out += "{";
      bool first = true;
      for (const auto& [k, e] : v.as_dict()) {
        if (!first) out += ", ";
        first = false;
        out += repr_string(k) + ": ";
        repr_into(out, e, depth + 1);
      }
      out += "}";
      return;
    }
    case Value::Kind::Object:
      if (auto* ns = dynamic_cast<Namespace*>(v.as_object())) {
        out += "<Namespace ";
        repr_into(out, Value::dict(ns->attrs()), depth + 1);
        out += ">";
        return;
      }
      fail("unsupported: printing a " + type_name(v) + " (Python prints its memory address)");
    default:
      out += to_str(v);
  }
}

}  // namespace

std::string repr(const Value& v) {
  std::string out;
  repr_into(out, v, 0);
  return out;
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return "";
    case Value::Kind::None: return "None";
    case Value::Kind::Bool: return v.as_bool() ? "True" : "False";
    case Value::Kind::Int: return std::to_string(v.as_int());
    case Value::Kind::Float: return float_repr(v.as_double());
    case Value::Kind::String: return v.as_string();
    default: return repr(v);
  }
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return false;
    case Value::Kind::Bool: return v.as_bool();
    case Value::Kind::Int: return v.as_int() != 0;
    case Value::Kind::Float: return v.as_double() != 0;  // nan is true, as in Python
    case Value::Kind::String: return !v.as_string().empty();
    case Value::Kind::List: return !v.as_list().empty();
    case Value::Kind::Dict: return !v.as_dict().empty();
    case Value::Kind::Object: return true;
  }
  return false;
}

// --- == and < ---

namespace {

bool int_like(const Value& v) { return v.kind() == Value::Kind::Bool || v.kind() == Value::Kind::Int; }

bool equals_at(const Value& a, const Value& b, int depth) {
  if (depth > kMaxValueDepth) fail("values nested too deeply to compare");
  if (a.is_number() && b.is_number()) {
    if (int_like(a) && int_like(b)) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String: return a.as_string() == b.as_string();
    case Value::Kind::List: {
      const auto& x = a.as_list();
      const auto& y = b.as_list();
      const bool a_list_like = a.seq() == Value::Seq::List || a.seq() == Value::Seq::Tuple || a.seq() == Value::Seq::Range;
      if (a.seq() != b.seq()) return false;
      if (a.seq() == Value::Seq::Values) return &x == &y;  // dict_values compare by identity
      if (x.size() != y.size()) return false;
      if (a_list_like) {
        for (size_t i = 0; i < x.size(); ++i)
          if (!equals_at(x[i], y[i], depth + 1)) return false;
        return true;
      }
      for (const auto& e : x) {  // keys/items views compare as sets
        bool found = false;
        for (const auto& f : y)
          if (equals_at(e, f, depth + 1)) {
            found = true;
            break;
          }
        if (!found) return false;
      }
      return true;
    }
    case Value::Kind::Dict: {
      if (a.as_dict().size() != b.as_dict().size()) return false;
      for (const auto& [k, v] : a.as_dict()) {
        const Value* w = b.find(k);
        if (!w || !equals_at(v, *w, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::Object: return a.as_object() == b.as_object();
    default: return false;
  }
}

}  // namespace

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

bool less(const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (int_like(a) && int_like(b)) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // UTF-8 order is code point order
  if (a.is_list() && b.is_list() && a.seq() == b.seq() &&
      (a.seq() == Value::Seq::List || a.seq() == Value::Seq::Tuple)) {
    const auto& x = a.as_list();
    const auto& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return less(x[i], y[i]);
    return x.size() < y.size();
  }
  fail("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// --- iteration and len() ---

std::vector<Value> iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::String: {
      std::vector<Value> out;
      for (char32_t c : utf8_decode(v.as_string())) {
        std::string s;
        utf8_append(s, c);
        out.push_back(Value::string(std::move(s)));
      }
      return out;
    }
    case Value::Kind::List: return v.as_list();
    case Value::Kind::Dict: {
      std::vector<Value> out;
      for (const auto& [k, e] : v.as_dict()) out.push_back(Value::string(k));
      return out;
    }
    case Value::Kind::Object:
      if (auto* g = dynamic_cast<Generator*>(v.as_object())) return g->take();
      break;
    default: break;
  }
  fail(in_quotes(type_name(v)) + " object is not iterable");
}

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return 0;
    case Value::Kind::String: return static_cast<int64_t>(utf8_length(v.as_string()));
    case Value::Kind::List: return static_cast<int64_t>(v.as_list().size());
    case Value::Kind::Dict: return static_cast<int64_t>(v.as_dict().size());
    default: fail("object of type '" + type_name(v) + "' has no len()");
  }
}

// --- arithmetic ---

namespace {

[[noreturn]] void overflow() {
  fail("integer overflow: the result does not fit in 64 bits (Python would use a big integer)");
}

[[noreturn]] void unsupported_operand(const char* op, const Value& a, const Value& b) {
  fail(std::string("unsupported operand type(s) for ") + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// markupsafe.escape
std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '\'': out += "&#39;"; break;
      case '"': out += "&#34;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

Value repeat_seq(const Value& seq, int64_t n) {
  if (n <= 0) return seq.is_string() ? Value::string("") : Value::list({}, seq.seq());
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    if (!s.empty() && static_cast<uint64_t>(n) > kMaxValueBytes / s.size()) fail("string repetition exceeds the size limit");
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out += s;
    return seq.is_markup() ? Value::markup(std::move(out)) : Value::string(std::move(out));
  }
  const auto& items = seq.as_list();
  if (!items.empty() && static_cast<uint64_t>(n) > kMaxValueBytes / sizeof(Value) / items.size())
    fail("list repetition exceeds the size limit");
  Value::List out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
  return Value::list(std::move(out), seq.seq());
}

// CPython float_divmod
void float_divmod(double vx, double wx, double& div, double& mod) {
  if (wx == 0) fail("float divmod()");
  mod = std::fmod(vx, wx);
  div = (vx - mod) / wx;
  if (mod != 0) {
    if ((wx < 0) != (mod < 0)) {
      mod += wx;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, wx);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, vx / wx);
  }
  div = floordiv;
}

}  // namespace

Value binary_op(BinOp op, const Value& a, const Value& b) {
  if (op == BinOp::Mod && a.is_string()) fail("unsupported: printf-style string formatting with %");
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const bool nums = a.is_number() && b.is_number();
  const bool ints = int_like(a) && int_like(b);
  switch (op) {
    case BinOp::Add:
      if (ints) {
        int64_t r;
        if (__builtin_add_overflow(a.as_int(), b.as_int(), &r)) overflow();
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) {
        if (a.is_markup() || b.is_markup()) {  // Markup.__add__/__radd__ escape the plain side
          const std::string l = a.is_markup() ? a.as_string() : html_escape(a.as_string());
          const std::string r = b.is_markup() ? b.as_string() : html_escape(b.as_string());
          return Value::markup(l + r);
        }
        if (a.as_string().size() + b.as_string().size() > kMaxValueBytes) fail("string exceeds the size limit");
        return Value::string(a.as_string() + b.as_string());
      }
      if (a.is_list() && b.is_list() && a.seq() == b.seq() &&
          (a.seq() == Value::Seq::List || a.seq() == Value::Seq::Tuple)) {
        Value::List out = a.as_list();
        out.insert(out.end(), b.as_list().begin(), b.as_list().end());
        return make_list_checked(std::move(out), a.seq());
      }
      if (a.is_string() || (a.is_list() && (a.seq() == Value::Seq::List || a.seq() == Value::Seq::Tuple)))
        fail("can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a));
      unsupported_operand("+", a, b);
    case BinOp::Sub:
      if (ints) {
        int64_t r;
        if (__builtin_sub_overflow(a.as_int(), b.as_int(), &r)) overflow();
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() - b.as_double());
      unsupported_operand("-", a, b);
    case BinOp::Mul:
      if (ints) {
        int64_t r;
        if (__builtin_mul_overflow(a.as_int(), b.as_int(), &r)) overflow();
        return Value::integer(r);
      }
      if (nums) return Value::number(a.as_double() * b.as_double());
      if ((a.is_string() || (a.is_list() && a.seq() <= Value::Seq::Tuple)) && int_like(b)) return repeat_seq(a, b.as_int());
      if ((b.is_string() || (b.is_list() && b.seq() <= Value::Seq::Tuple)) && int_like(a)) return repeat_seq(b, a.as_int());
      if (a.is_string() || b.is_string() || a.is_list() || b.is_list())
        fail("can't multiply sequence by non-int of type '" + type_name(a.is_string() || a.is_list() ? b : a) + "'");
      unsupported_operand("*", a, b);
    case BinOp::Div:
      if (nums) {
        if (b.as_double() == 0) fail(ints ? "division by zero" : "float division by zero");
        return Value::number(a.as_double() / b.as_double());
      }
      unsupported_operand("/", a, b);
    case BinOp::FloorDiv:
    case BinOp::Mod:
      if (ints) {
        const int64_t x = a.as_int(), y = b.as_int();
        if (y == 0) fail("integer division or modulo by zero");
        if (x == std::numeric_limits<int64_t>::min() && y == -1) {
          if (op == BinOp::FloorDiv) overflow();
          return Value::integer(0);
        }
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          q -= 1;
          r += y;
        }
        return Value::integer(op == BinOp::FloorDiv ? q : r);
      }
      if (nums) {
        if (b.as_double() == 0) fail(op == BinOp::Mod ? "float modulo" : "float floor division by zero");
        double div, mod;
        float_divmod(a.as_double(), b.as_double(), div, mod);
        return Value::number(op == BinOp::FloorDiv ? div : mod);
      }
      unsupported_operand(op == BinOp::Mod ? "%" : "//", a, b);
    case BinOp::Pow:
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), e = b.as_int(), r = 1;
        while (e > 0) {
          if (e & 1)
            if (__builtin_mul_overflow(r, base, &r)) overflow();
          e >>= 1;
          if (e > 0 && __builtin_mul_overflow(base, base, &base)) overflow();
        }
        return Value::integer(r);
      }
      if (nums) {
        const double x = a.as_double(), y = b.as_double();
        if (x == 0 && y < 0) fail("0.0 cannot be raised to a negative power");
        if (x < 0 && y != std::floor(y)) fail("unsupported: a negative number to a fractional power is complex");
        return Value::number(std::pow(x, y));
      }
      unsupported_operand("** or pow()", a, b);
  }
  fail("unknown operator");
}

Value negate(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (int_like(v)) {
    if (v.as_int() == std::numeric_limits<int64_t>::min()) overflow();
    return Value::integer(-v.as_int());
  }
  if (v.kind() == Value::Kind::Float) return Value::number(-v.as_double());
  fail("bad operand type for unary -: '" + type_name(v) + "'");
}

Value unary_plus(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (int_like(v)) return Value::integer(v.as_int());
  if (v.kind() == Value::Kind::Float) return v;
  fail("bad operand type for unary +: '" + type_name(v) + "'");
}

void check_hashable(const Value& v) {
  if (v.is_dict() || (v.is_list() && v.seq() != Value::Seq::Tuple && v.seq() != Value::Seq::Range))
    fail("unhashable type: " + in_quotes(type_name(v)));
  if (v.is_list())
    for (const auto& e : v.as_list()) check_hashable(e);
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::Undefined: return false;
    case Value::Kind::String:
      if (!item.is_string())
        fail("'in <string>' requires string as left operand, not " + type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::List:
      for (const auto& e : container.as_list())
        if (equals(e, item)) return true;
      return false;
    case Value::Kind::Dict:
      check_hashable(item);
      return item.is_string() && container.find(item.as_string()) != nullptr;
    case Value::Kind::Object:
      if (auto* g = dynamic_cast<Generator*>(container.as_object())) {
        Value e;
        while (g->next(e))
          if (equals(e, item)) return true;
        return false;
      }
      break;
    default: break;
  }
  fail("argument of type '" + type_name(container) + "' is not iterable");
}

// --- json.dumps ---

namespace {

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out.push_back('"');
  char buf[16];
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else if (ensure_ascii && c > 0x7E) {
          if (c > 0xFFFF) {
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          utf8_append(out, c);
        }
    }
  }
  out.push_back('"');
}

void json_value(std::string& out, const Value& v, const JsonStyle& st, int level) {
  if (level > kMaxValueDepth) fail("value nested too deeply for tojson");
  const auto newline = [&](int lvl) {
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += st.indent;
  };
  switch (v.kind()) {
    case Value::Kind::None: out += "null"; return;
    case Value::Kind::Bool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::Int: out += std::to_string(v.as_int()); return;
    case Value::Kind::Float: {
      const double d = v.as_double();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d < 0 ? "-Infinity" : "Infinity";
      else out += float_repr(d);
      return;
    }
    case Value::Kind::String: json_string(out, v.as_string(), st.ensure_ascii); return;
    case Value::Kind::List: {
      if (v.seq() != Value::Seq::List && v.seq() != Value::Seq::Tuple) break;
      const auto& items = v.as_list();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.has_indent) newline(level + 1);
        json_value(out, items[i], st, level + 1);
      }
      if (st.has_indent) newline(level);
      out.push_back(']');
      return;
    }
    case Value::Kind::Dict: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.as_dict()) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* x, auto* y) { return x->first < y->first; });
      out.push_back('{');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += st.item_sep;
        if (st.has_indent) newline(level + 1);
        json_string(out, items[i]->first, st.ensure_ascii);
        out += st.key_sep;
        json_value(out, items[i]->second, st, level + 1);
      }
      if (st.has_indent) newline(level);
      out.push_back('}');
      return;
    }
    default: break;
  }
  fail("Object of type " + type_name(v) + " is not JSON serializable");
}

}  // namespace

std::string json_dumps(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(out, v, style, 0);
  return out;
}

}  // namespace strata::text::jinja
