// What the sandboxed environment resolves by name: obj.attr and obj[key] (dict methods before
// keys, the immutable sandbox's refusal of list.append & co.), slices, the builtin filters and
// tests with Jinja 3.1's definitions, and the globals (range, namespace, dict, raise_exception,
// strftime_now). A filter, test or method Python has and this does not is an error when used.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

// --- argument binding ---

std::vector<Value> bind_args(std::string_view fn_name, const CallArgs& args, const std::vector<std::string_view>& params,
                             const std::vector<Value>& defaults) {
  const std::string fn(fn_name);
  if (args.positional.size() > params.size())
    fail(fn + "() takes at most " + std::to_string(params.size()) + " argument(s) (" +
         std::to_string(args.positional.size()) + " given)");
  std::vector<Value> out(params.size());
  std::vector<bool> given(params.size(), false);
  for (size_t i = 0; i < args.positional.size(); ++i) {
    out[i] = args.positional[i];
    given[i] = true;
  }
  for (const auto& [k, v] : args.keyword) {
    const auto it = std::find(params.begin(), params.end(), k);
    if (it == params.end()) fail(fn + "() got an unexpected keyword argument '" + k + "'");
    const auto i = static_cast<size_t>(it - params.begin());
    if (given[i]) fail(fn + "() got multiple values for argument '" + k + "'");
    out[i] = v;
    given[i] = true;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (given[i]) continue;
    if (i >= defaults.size() || defaults[i].is_undefined())
      fail(fn + "() missing required argument '" + std::string(params[i]) + "'");
    out[i] = defaults[i];
  }
  return out;
}

namespace {

Value undefined_attr(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}
Value undefined_item(const Value& obj, const Value& key) {
  if (key.is_string()) return undefined_attr(obj, key.as_string());
  return Value::undefined(object_type_repr(obj) + " has no element " + repr(key));
}
Value unsafe(const Value& obj, const std::string& name) {
  return Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
}

bool int_like(const Value& v) { return v.kind() == Value::Kind::Bool || v.kind() == Value::Kind::Int; }

Value method(const Value& self, const std::string& name, std::function<Value(const Value&, const CallArgs&)> fn) {
  return make_function(name, [self, fn = std::move(fn)](Context&, const CallArgs& a) { return fn(self, a); });
}

// dict.get/keys/values/items/copy; the sandbox refuses the mutating ones.
bool dict_attr(const Value& d, const std::string& name, Value& out) {
  if (name == "get") {
    out = method(d, "get", [](const Value& self, const CallArgs& a) {
      const auto v = bind_args("get", a, {"key", "default"}, {Value(), Value::none()});
      if (v[0].is_list() || v[0].is_dict()) fail("unhashable type: '" + type_name(v[0]) + "'");
      const Value* found = v[0].is_string() ? self.find(v[0].as_string()) : nullptr;
      return found ? *found : v[1];
    });
  } else if (name == "keys" || name == "values" || name == "items") {
    out = method(d, name, [name](const Value& self, const CallArgs& a) {
      bind_args(name, a, {}, {});
      Value::List items;
      for (const auto& [k, v] : self.as_dict()) {
        if (name == "keys") items.push_back(Value::string(k));
        else if (name == "values") items.push_back(v);
        else items.push_back(Value::tuple({Value::string(k), v}));
      }
      return Value::list(std::move(items), name == "keys" ? Value::Seq::Keys : name == "values" ? Value::Seq::Values : Value::Seq::Items);
    });
  } else if (name == "copy") {
    out = method(d, name, [](const Value& self, const CallArgs& a) {
      bind_args("copy", a, {}, {});
      return self;
    });
  } else if (name == "clear" || name == "pop" || name == "popitem" || name == "setdefault" || name == "update") {
    out = unsafe(d, name);
  } else if (name == "fromkeys") {
    fail("unsupported dict method '" + name + "'");
  } else {
    return false;
  }
  return true;
}

bool list_attr(const Value& l, const std::string& name, Value& out) {
  const bool mutable_list = l.seq() == Value::Seq::List;
  if (name == "index") {
    out = method(l, name, [](const Value& self, const CallArgs& a) {
      const auto v = bind_args("index", a, {"value"}, {Value()});
      const auto& items = self.as_list();
      for (size_t i = 0; i < items.size(); ++i)
        if (equals(items[i], v[0])) return Value::integer(static_cast<int64_t>(i));
      fail(repr(v[0]) + " is not in list");
    });
  } else if (name == "count") {
    out = method(l, name, [](const Value& self, const CallArgs& a) {
      const auto v = bind_args("count", a, {"value"}, {Value()});
      int64_t n = 0;
      for (const auto& e : self.as_list()) n += equals(e, v[0]);
      return Value::integer(n);
    });
  } else if (mutable_list && name == "copy") {
    out = method(l, name, [](const Value& self, const CallArgs&) { return self; });
  } else if (mutable_list && (name == "append" || name == "clear" || name == "extend" || name == "insert" || name == "pop" ||
                              name == "remove" || name == "reverse" || name == "sort")) {
    out = unsafe(l, name);
  } else {
    return false;
  }
  return true;
}

bool is_number_attr(const std::string& name) {
  static const char* const kNames[] = {"real", "imag", "numerator", "denominator", "conjugate", "bit_length", "bit_count",
                                       "to_bytes", "from_bytes", "as_integer_ratio", "is_integer", "hex", "fromhex"};
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_' && !obj.is_dict()) return unsafe(obj, name);
  Value out;
  switch (obj.kind()) {
    case Value::Kind::String: {
      Value m = string_method(obj, name);
      return m.is_undefined() ? undefined_attr(obj, name) : m;
    }
    case Value::Kind::Dict:
      if (dict_attr(obj, name, out)) return out;
      if (const Value* v = obj.find(name)) return *v;
      return undefined_attr(obj, name);
    case Value::Kind::List:
      if (list_attr(obj, name, out)) return out;
      return undefined_attr(obj, name);
    case Value::Kind::Object:
      if (obj.as_object()->attr(name, out)) return out;
      return undefined_attr(obj, name);
    case Value::Kind::Bool:
    case Value::Kind::Int:
    case Value::Kind::Float:
      if (is_number_attr(name)) fail("unsupported attribute '" + name + "' of " + type_name(obj));
      return undefined_attr(obj, name);
    default:
      return undefined_attr(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  switch (obj.kind()) {
    case Value::Kind::Dict:
      if (key.is_string()) {
        if (const Value* v = obj.find(key.as_string())) return *v;
        Value out;
        if (dict_attr(obj, key.as_string(), out)) return out;
      }
      return undefined_item(obj, key);
    case Value::Kind::List:
      if (int_like(key) && obj.seq() <= Value::Seq::Range) {
        const auto& items = obj.as_list();
        int64_t i = key.as_int();
        if (i < 0) i += static_cast<int64_t>(items.size());
        if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[static_cast<size_t>(i)];
      }
      if (key.is_string()) {
        Value out;
        if (list_attr(obj, key.as_string(), out)) return out;
      }
      return undefined_item(obj, key);
    case Value::Kind::String:
      if (int_like(key)) {
        const std::vector<char32_t> cps = utf8_decode(obj.as_string());
        int64_t i = key.as_int();
        if (i < 0) i += static_cast<int64_t>(cps.size());
        if (i >= 0 && i < static_cast<int64_t>(cps.size())) {
          std::string s;
          utf8_append(s, cps[static_cast<size_t>(i)]);
          return Value::string(std::move(s));
        }
      }
      if (key.is_string()) return get_attr(obj, key.as_string());
      return undefined_item(obj, key);
    default:
      if (key.is_string()) return get_attr(obj, key.as_string());
      return undefined_item(obj, key);
  }
}

Value get_slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (obj.is_undefined()) fail_undefined(obj);
  // Jinja compiles a slice to a plain Python subscript (not environment.getitem): every failure
  // is a TypeError.
  const auto index_ok = [](const Value& v) { return v.is_none() || int_like(v); };
  if (!index_ok(start_v) || !index_ok(stop_v) || !index_ok(step_v))
    fail("slice indices must be integers or None or have an __index__ method");
  const bool is_str = obj.is_string();
  if (obj.is_dict()) fail("unhashable type: 'slice'");
  if (!is_str && !(obj.is_list() && obj.seq() <= Value::Seq::Range)) fail("'" + type_name(obj) + "' object is not subscriptable");
  std::vector<char32_t> cps;
  if (is_str) cps = utf8_decode(obj.as_string());
  const int64_t len = is_str ? static_cast<int64_t>(cps.size()) : static_cast<int64_t>(obj.as_list().size());
  const int64_t step = step_v.is_none() ? 1 : step_v.as_int();
  if (step == 0) fail("slice step cannot be zero");
  const auto adjust = [&](const Value& v, int64_t dflt) {
    if (v.is_none()) return dflt;
    int64_t i = v.as_int();
    if (i < 0) {
      i += len;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= len) {
      i = step < 0 ? len - 1 : len;
    }
    return i;
  };
  const int64_t start = adjust(start_v, step < 0 ? len - 1 : 0);
  const int64_t stop = adjust(stop_v, step < 0 ? -1 : len);
  std::vector<size_t> idx;
  if (step > 0) {
    for (int64_t i = start; i < stop; i += step) idx.push_back(static_cast<size_t>(i));
  } else {
    for (int64_t i = start; i > stop; i += step) idx.push_back(static_cast<size_t>(i));
  }
  if (is_str) {
    std::string out;
    for (size_t i : idx) utf8_append(out, cps[i]);
    return obj.is_markup() ? Value::markup(std::move(out)) : Value::string(std::move(out));
  }
  Value::List out;
  for (size_t i : idx) out.push_back(obj.as_list()[i]);
  return Value::list(std::move(out), obj.seq());
}

// --- filters ---

namespace {

std::string soft_str(const Value& v) { return v.is_string() ? v.as_string() : to_str(v); }

// Python str.strip()-based number parsing for the int and float filters.
bool parse_py_float(const std::string& raw, double& out) {
  std::string s = py_strip(raw, Value::none(), true, true);
  std::string lower = py_lower(s);
  std::string body = lower;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body = body.substr(1);
  if (body == "inf" || body == "infinity" || body == "nan") {
    out = body == "nan" ? std::nan("") : INFINITY;
    if (lower[0] == '-') out = -out;
    return true;
  }
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {  // only between digits
      if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[i + 1])))
        return false;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c)) && !std::strchr("+-.eE", c)) return false;
    clean.push_back(c);
  }
  if (clean.empty()) return false;
  char* end = nullptr;
  out = std::strtod(clean.c_str(), &end);
  return end == clean.c_str() + clean.size();
}

bool parse_py_int(const std::string& raw, int base, int64_t& out) {
  std::string s = py_strip(raw, Value::none(), true, true);
  bool neg = false;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (base == 16 && s.size() > i + 1 && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X')) i += 2;
  else if (base == 8 && s.size() > i + 1 && s[i] == '0' && (s[i + 1] == 'o' || s[i + 1] == 'O')) i += 2;
  else if (base == 2 && s.size() > i + 1 && s[i] == '0' && (s[i + 1] == 'b' || s[i + 1] == 'B')) i += 2;
  if (i >= s.size()) return false;
  __int128 v = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {
      if (!prev_digit || i + 1 >= s.size()) return false;
      prev_digit = false;
      continue;
    }
    int d;
    if (std::isdigit(static_cast<unsigned char>(c))) d = c - '0';
    else if (std::isalpha(static_cast<unsigned char>(c))) d = std::tolower(static_cast<unsigned char>(c)) - 'a' + 10;
    else return false;
    if (d >= base) return false;
    v = v * base + d;
    if (v > static_cast<__int128>(INT64_MAX) + 1) fail("integer overflow: the result does not fit in 64 bits (Python would use a big integer)");
    prev_digit = true;
  }
  if (!prev_digit) return false;
  if (neg) v = -v;
  if (v > INT64_MAX) fail("integer overflow: the result does not fit in 64 bits (Python would use a big integer)");
  out = static_cast<int64_t>(v);
  return true;
}

Value float_to_int(double d) {
  if (std::isnan(d)) fail("cannot convert float NaN to integer");
  if (std::isinf(d)) fail("cannot convert float infinity to integer");
  const double t = std::trunc(d);
  if (t >= 9.2233720368547758e18 || t < -9.2233720368547758e18)
    fail("integer overflow: the result does not fit in 64 bits (Python would use a big integer)");
  return Value::integer(static_cast<int64_t>(t));
}

Value filter_int(const Value& value, const Value& dflt, const Value& base_v) {
  if (value.is_undefined()) fail_undefined(value);
  if (!int_like(base_v)) fail("int() base must be an integer");
  const int base = static_cast<int>(base_v.as_int());
  if (value.is_string()) {
    int64_t i;
    if (parse_py_int(value.as_string(), base, i)) return Value::integer(i);
    double d;
    if (parse_py_float(value.as_string(), d) && !std::isnan(d)) {
      if (std::isinf(d)) fail("cannot convert float infinity to integer");
      return float_to_int(d);
    }
    return dflt;
  }
  if (int_like(value)) return Value::integer(value.as_int());
  if (value.kind() == Value::Kind::Float) {
    if (std::isnan(value.as_double())) return dflt;
    return float_to_int(value.as_double());
  }
  return dflt;
}

Value filter_float(const Value& value, const Value& dflt) {
  if (value.is_undefined()) fail_undefined(value);
  if (value.is_number()) return Value::number(value.as_double());
  double d;
  if (value.is_string() && parse_py_float(value.as_string(), d)) return Value::number(d);
  return dflt;
}

// make_attrgetter: "a.b.0" walks getitem; integer parts index.
Value attr_path(const Value& item, const Value& attribute, const Value& dflt = Value::none()) {
  Value cur = item;
  std::vector<Value> parts;
  if (attribute.is_string()) {
    std::string s = attribute.as_string();
    size_t start = 0;
    while (true) {
      const size_t dot = s.find('.', start);
      std::string part = s.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      parts.push_back(digits ? Value::integer(std::stoll(part)) : Value::string(part));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  } else if (!attribute.is_none() && !attribute.is_undefined()) {
    parts.push_back(attribute);
  }
  for (const auto& p : parts) {
    cur = get_item(cur, p);
    if (!dflt.is_none() && cur.is_undefined()) cur = dflt;
  }
  return cur;
}

Value ignore_case(const Value& v) { return v.is_string() ? Value::string(py_lower(v.as_string())) : v; }

std::vector<Value> select_or_reject(Context& ctx, const Value& value, const CallArgs& args, bool lookup_attr, bool select) {
  std::vector<Value> out;
  if (!truthy(value)) return out;
  size_t off = 0;
  Value attribute;
  if (lookup_attr) {
    if (args.positional.empty()) fail("Missing parameter for attribute name");
    attribute = args.positional[0];
    off = 1;
  }
  const bool has_test = args.positional.size() > off;
  std::string test;
  CallArgs test_args;
  if (has_test) {
    if (!args.positional[off].is_string()) fail("test name must be a string");
    test = args.positional[off].as_string();
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(off + 1), args.positional.end());
    test_args.keyword = args.keyword;
  }
  for (const auto& item : iterate(value)) {
    const Value subject = lookup_attr ? attr_path(item, attribute) : item;
    const bool hit = has_test ? call_test(ctx, test, subject, test_args) : truthy(subject);
    if (hit == select) out.push_back(item);
  }
  return out;
}

std::vector<Value> sorted_values(std::vector<Value> items, bool reverse, bool case_sensitive, const Value& attribute) {
  if (attribute.is_string() && attribute.as_string().find(',') != std::string::npos)
    fail("unsupported: sorting by several attributes");
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& it : items) {
    Value key = attr_path(it, attribute);
    if (!case_sensitive) key = ignore_case(key);
    keyed.emplace_back(std::move(key), std::move(it));
  }
  std::stable_sort(keyed.begin(), keyed.end(), [reverse](const auto& a, const auto& b) {
    return reverse ? less(b.first, a.first) : less(a.first, b.first);
  });
  std::vector<Value> out;
  for (auto& kv : keyed) out.push_back(std::move(kv.second));
  return out;
}

Value min_max(const Value& value, bool is_max, bool case_sensitive, const Value& attribute) {
  std::vector<Value> items = iterate(value);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  const auto key = [&](const Value& v) {
    Value k = attr_path(v, attribute);
    return case_sensitive ? k : ignore_case(k);
  };
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    if (is_max ? less(best_key, k) : less(k, best_key)) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

std::string indent_filter(const std::string& s_in, const Value& width, bool first, bool blank) {
  const std::string indention = width.is_string() ? width.as_string() : std::string(static_cast<size_t>(std::max<int64_t>(0, width.as_int())), ' ');
  const std::string s = s_in + "\n";
  std::vector<std::string> lines = py_splitlines(s, false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return rv;
}

Value round_filter(const Value& value, const Value& precision_v, const std::string& method) {
  if (method != "common" && method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
  if (!int_like(precision_v)) fail("'" + type_name(precision_v) + "' object cannot be interpreted as an integer");
  const int64_t precision = precision_v.as_int();
  if (!value.is_number()) fail("type " + type_name(value) + " doesn't define __round__ method");
  if (method == "common") {
    if (int_like(value)) {
      if (precision >= 0) return Value::integer(value.as_int());
      fail("unsupported: round() of an integer to negative digits");
    }
    const double d = value.as_double();
    if (!std::isfinite(d)) return value;
    if (precision >= 0 && precision <= 300) {
      char buf[512];
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), d);  // correctly rounded, ties to even
      return Value::number(std::strtod(buf, nullptr));
    }
    const double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value::number(std::nearbyint(d / scale) * scale);
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double r = method == "ceil" ? std::ceil(value.as_double() * scale) : std::floor(value.as_double() * scale);
  return Value::number(r / scale);
}

std::string title_filter(const std::string& s) {
  // "".join(item[0].upper() + item[1:].lower() for item in re.split(r"([-\s({\[<]+)", s) if item)
  const std::vector<char32_t> cps = utf8_decode(s);
  const auto is_sep = [](char32_t c) { return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c); };
  std::string out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool sep = is_sep(cps[i]);
    while (j < cps.size() && is_sep(cps[j]) == sep) ++j;
    const std::string item = utf8_encode(cps, i, j);
    if (sep) {
      out += item;
    } else {
      out += py_upper(utf8_encode(cps, i, i + 1)) + py_lower(utf8_encode(cps, i + 1, j));
    }
    i = j;
  }
  return out;
}

JsonStyle json_style(const Value& ensure_ascii, const Value& indent, const Value& separators, const Value& sort_keys) {
  JsonStyle st;
  st.ensure_ascii = truthy(ensure_ascii);
  st.sort_keys = truthy(sort_keys);
  if (!indent.is_none()) {
    st.has_indent = true;
    if (int_like(indent)) st.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, indent.as_int())), ' ');
    else if (indent.is_string()) st.indent = indent.as_string();
    else fail("unsupported tojson indent of type " + type_name(indent));
    st.item_sep = ",";
  }
  if (!separators.is_none()) {
    if (!separators.is_list() || separators.as_list().size() != 2 || !separators.as_list()[0].is_string() ||
        !separators.as_list()[1].is_string())
      fail("tojson separators must be a pair of strings");
    st.item_sep = separators.as_list()[0].as_string();
    st.key_sep = separators.as_list()[1].as_string();
  }
  return st;
}

// Filters that accept a |safe (Markup) value without changing what Python would produce.
bool markup_ok(std::string_view name) {
  static const char* const kOk[] = {"safe", "length", "count", "string", "tojson", "default", "d", "list", "first", "last"};
  for (const char* k : kOk)
    if (name == k) return true;
  return false;
}

}  // namespace

bool is_known_filter(std::string_view name) {
  static const char* const kNames[] = {"abs", "capitalize", "count", "d", "default", "dictsort", "first", "float", "indent",
                                       "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min",
                                       "reject", "rejectattr", "replace", "reverse", "round", "safe", "select",
                                       "selectattr", "sort", "string", "sum", "title", "tojson", "trim", "unique", "upper"};
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

Value call_filter(Context& ctx, const std::string& name, const Value& value, const CallArgs& args) {
  if (!is_known_filter(name)) fail("unsupported filter '" + name + "'");
  if (value.is_markup() && !markup_ok(name)) fail("unsupported: filter '" + name + "' on a |safe string");
  const auto bind = [&](const std::vector<std::string_view>& params, const std::vector<Value>& defaults) {
    return bind_args(name, args, params, defaults);
  };
  if (name == "trim") {
    const auto a = bind({"chars"}, {Value::none()});
    return Value::string(py_strip(soft_str(value), a[0], true, true));
  }
  if (name == "length" || name == "count") {
    bind({}, {});
    return Value::integer(length(value));
  }
  if (name == "tojson") {
    const auto a = bind({"ensure_ascii", "indent", "separators", "sort_keys"},
                        {Value::boolean(false), Value::none(), Value::none(), Value::boolean(false)});
    return make_string_checked(json_dumps(value, json_style(a[0], a[1], a[2], a[3])));
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    bind({}, {});
    const std::string s = soft_str(value);
    if (name == "upper") return Value::string(py_upper(s));
    if (name == "lower") return Value::string(py_lower(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    return Value::string(title_filter(s));
  }
  if (name == "default" || name == "d") {
    const auto a = bind({"default_value", "boolean"}, {Value::string(""), Value::boolean(false)});
    if (value.is_undefined() || (truthy(a[1]) && !truthy(value))) return a[0];
    return value;
  }
  if (name == "items") {
    bind({}, {});
    if (value.is_undefined()) return make_generator({});
    if (!value.is_dict()) fail("Can only get item pairs from a mapping.");
    std::vector<Value> items;
    for (const auto& [k, v] : value.as_dict()) items.push_back(Value::tuple({Value::string(k), v}));
    return make_generator(std::move(items));
  }
  if (name == "join") {
    const auto a = bind({"d", "attribute"}, {Value::string(""), Value::none()});
    std::string sep = soft_str(a[0]), out;
    bool first = true;
    for (const auto& item : iterate(value)) {
      if (!first) out += sep;
      first = false;
      out += soft_str(a[1].is_none() ? item : attr_path(item, a[1]));
      if (out.size() > kMaxValueBytes) fail("joined string exceeds the size limit");
    }
    return Value::string(std::move(out));
  }
  if (name == "first") {
    bind({}, {});
    if (auto* g = dynamic_cast<Generator*>(value.as_object())) {
      Value v;
      return g->next(v) ? v : Value::undefined("No first item, sequence was empty.");
    }
    std::vector<Value> items = iterate(value);
    return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
  }
  if (name == "last") {
    bind({}, {});
    if (value.kind() == Value::Kind::Object) fail("'" + type_name(value) + "' object is not reversible");
    std::vector<Value> items = iterate(value);
    return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
  }
  if (name == "selectattr" || name == "rejectattr")
    return make_generator(select_or_reject(ctx, value, args, true, name == "selectattr"));
  if (name == "select" || name == "reject")
    return make_generator(select_or_reject(ctx, value, args, false, name == "select"));
  if (name == "map") {
    std::vector<Value> out;
    const bool by_attr = args.positional.empty() && std::any_of(args.keyword.begin(), args.keyword.end(),
                                                                [](const auto& kv) { return kv.first == "attribute"; });
    if (by_attr) {
      const auto a = bind_args("map", CallArgs{{}, args.keyword}, {"attribute", "default"}, {Value(), Value::none()});
      if (truthy(value))
        for (const auto& item : iterate(value)) out.push_back(attr_path(item, a[0], a[1]));
    } else {
      if (args.positional.empty()) fail("map requires a filter name or attribute=");
      if (!args.positional[0].is_string()) fail("map filter name must be a string");
      CallArgs rest{std::vector<Value>(args.positional.begin() + 1, args.positional.end()), args.keyword};
      if (truthy(value))
        for (const auto& item : iterate(value)) out.push_back(call_filter(ctx, args.positional[0].as_string(), item, rest));
    }
    return make_generator(std::move(out));
  }
  if (name == "list") {
    bind({}, {});
    return make_list_checked(iterate(value));
  }
  if (name == "string") {
    bind({}, {});
    return value.is_string() ? value : Value::string(to_str(value));
  }
  if (name == "int") {
    const auto a = bind({"default", "base"}, {Value::integer(0), Value::integer(10)});
    return filter_int(value, a[0], a[1]);
  }
  if (name == "float") {
    const auto a = bind({"default"}, {Value::number(0.0)});
    return filter_float(value, a[0]);
  }
  if (name == "safe") {
    bind({}, {});
    return Value::markup(soft_str(value));
  }
  if (name == "replace") {
    const auto a = bind({"old", "new", "count"}, {Value(), Value(), Value::none()});
    CallArgs call{{Value::string(soft_str(a[0])), Value::string(soft_str(a[1]))}, {}};
    if (!a[2].is_none()) call.positional.push_back(a[2]);
    const Value m = string_method(Value::string(soft_str(value)), "replace");
    return call_value(ctx, m, call);
  }
  if (name == "reverse") {
    bind({}, {});
    if (value.is_string()) {
      std::vector<char32_t> cps = utf8_decode(value.as_string());
      std::reverse(cps.begin(), cps.end());
      return Value::string(utf8_encode(cps));
    }
    if (value.is_none() || value.kind() == Value::Kind::Int || value.kind() == Value::Kind::Float ||
        value.kind() == Value::Kind::Bool)
      fail("argument must be iterable");
    std::vector<Value> items = iterate(value);
    std::reverse(items.begin(), items.end());
    // reversed() of a sequence is an iterator in Python; of a generator, list() then reverse.
    if (value.kind() == Value::Kind::Object) return Value::list(std::move(items));
    return make_generator(std::move(items), "list_reverseiterator");
  }
  if (name == "unique") {
    const auto a = bind({"case_sensitive", "attribute"}, {Value::boolean(false), Value::none()});
    std::vector<Value> out, seen;
    for (const auto& item : iterate(value)) {
      Value key = attr_path(item, a[1]);
      if (!truthy(a[0])) key = ignore_case(key);
      if (key.is_list() || key.is_dict()) fail("unhashable type: '" + type_name(key) + "'");
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return make_generator(std::move(out));
  }
  if (name == "abs") {
    bind({}, {});
    if (int_like(value)) return value.as_int() < 0 ? negate(value) : Value::integer(value.as_int());
    if (value.kind() == Value::Kind::Float) return Value::number(std::fabs(value.as_double()));
    fail("bad operand type for abs(): '" + type_name(value) + "'");
  }
  if (name == "round") {
    const auto a = bind({"precision", "method"}, {Value::integer(0), Value::string("common")});
    return round_filter(value, a[0], soft_str(a[1]));
  }
  if (name == "sort") {
    const auto a = bind({"reverse", "case_sensitive", "attribute"}, {Value::boolean(false), Value::boolean(false), Value::none()});
    return Value::list(sorted_values(iterate(value), truthy(a[0]), truthy(a[1]), a[2]));
  }
  if (name == "dictsort") {
    const auto a = bind({"case_sensitive", "by", "reverse"}, {Value::boolean(false), Value::string("key"), Value::boolean(false)});
    if (!value.is_dict()) fail("'" + type_name(value) + "' object has no attribute 'items'");
    const std::string by = soft_str(a[1]);
    if (by != "key" && by != "value") fail("You can only sort by either \"key\" or \"value\"");
    std::vector<Value> items;
    for (const auto& [k, v] : value.as_dict()) items.push_back(Value::tuple({Value::string(k), v}));
    return Value::list(sorted_values(std::move(items), truthy(a[2]), truthy(a[0]), Value::integer(by == "key" ? 0 : 1)));
  }
  if (name == "sum") {
    const auto a = bind({"attribute", "start"}, {Value::none(), Value::integer(0)});
    if (a[1].is_string()) fail("sum() can't sum strings [use ''.join(seq) instead]");
    Value total = a[1];
    for (const auto& item : iterate(value)) total = binary_op(BinOp::Add, total, attr_path(item, a[0]));
    return total;
  }
  if (name == "min" || name == "max") {
    const auto a = bind({"case_sensitive", "attribute"}, {Value::boolean(false), Value::none()});
    return min_max(value, name == "max", truthy(a[0]), a[1]);
  }
  if (name == "indent") {
    const auto a = bind({"width", "first", "blank"}, {Value::integer(4), Value::boolean(false), Value::boolean(false)});
    if (!a[0].is_string() && !int_like(a[0])) fail("indent width must be an int or a string");
    return Value::string(indent_filter(soft_str(value), a[0], truthy(a[1]), truthy(a[2])));
  }
  fail("unsupported filter '" + name + "'");
}

// --- tests ---

bool is_known_test(std::string_view name) {
  static const char* const kNames[] = {"boolean", "callable", "defined", "divisibleby", "eq", "equalto", "==", "escaped",
                                       "even", "false", "float", "ge", ">=", "gt", "greaterthan", ">", "in", "integer",
                                       "iterable", "le", "<=", "lower", "lt", "lessthan", "<", "mapping", "ne", "!=",
                                       "none", "number", "odd", "sameas", "sequence", "string", "true", "undefined", "upper"};
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

bool call_test(Context&, const std::string& name, const Value& v, const CallArgs& args) {
  if (!is_known_test(name)) fail("unsupported test '" + name + "'");
  const auto one = [&](std::string_view param) { return bind_args(name, args, {param}, {Value()})[0]; };
  const auto none = [&] { bind_args(name, args, {}, {}); };
  if (name == "defined") return none(), !v.is_undefined();
  if (name == "undefined") return none(), v.is_undefined();
  if (name == "none") return none(), v.is_none();
  if (name == "boolean") return none(), v.kind() == Value::Kind::Bool;
  if (name == "false") return none(), v.kind() == Value::Kind::Bool && !v.as_bool();
  if (name == "true") return none(), v.kind() == Value::Kind::Bool && v.as_bool();
  if (name == "integer") return none(), v.kind() == Value::Kind::Int;
  if (name == "float") return none(), v.kind() == Value::Kind::Float;
  if (name == "number") return none(), v.is_number();
  if (name == "string") return none(), v.is_string();
  if (name == "mapping") return none(), v.is_dict();
  if (name == "escaped") return none(), v.is_markup();
  if (name == "callable") return none(), v.kind() == Value::Kind::Object && v.as_object()->is_callable();
  if (name == "iterable") {
    none();
    return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict() || dynamic_cast<Generator*>(v.as_object());
  }
  if (name == "sequence") {
    none();
    return v.is_undefined() || v.is_string() || v.is_dict() || (v.is_list() && v.seq() <= Value::Seq::Range);
  }
  if (name == "lower" || name == "upper") {
    none();
    const std::string s = to_str(v);
    bool cased = false;
    for (char32_t c : utf8_decode(s)) {
      const bool lo = py_islower_cp(c), up = py_isupper_cp(c) || py_istitle_cp(c);
      if (name == "lower" ? up : (lo || py_istitle_cp(c))) return false;
      if (name == "lower" ? lo : py_isupper_cp(c)) cased = true;
    }
    return cased;
  }
  if (name == "even" || name == "odd") {
    none();
    const Value r = binary_op(BinOp::Mod, v, Value::integer(2));
    return equals(r, Value::integer(name == "even" ? 0 : 1));
  }
  if (name == "divisibleby") return equals(binary_op(BinOp::Mod, v, one("num")), Value::integer(0));
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, one("other"));
  if (name == "ne" || name == "!=") return !equals(v, one("other"));
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, one("other"));
  if (name == "gt" || name == "greaterthan" || name == ">") return less(one("other"), v);
  if (name == "le" || name == "<=") {
    const Value o = one("other");
    return less(v, o) || equals(v, o);
  }
  if (name == "ge" || name == ">=") {
    const Value o = one("other");
    return less(o, v) || equals(v, o);
  }
  if (name == "in") return contains(one("seq"), v);
  if (name == "sameas") {
    const Value o = one("other");
    const auto simple = [](const Value& x) {
      return x.is_none() || x.is_undefined() || x.kind() == Value::Kind::Bool;
    };
    if (simple(v) || simple(o)) return v.kind() == o.kind() && equals(v, o);
    fail("unsupported: 'sameas' (object identity) between " + type_name(v) + " and " + type_name(o));
  }
  fail("unsupported test '" + name + "'");
}

// --- globals ---

std::string strftime_now(const std::string& format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::string buf(format.size() * 4 + 256, '\0');
  const size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
  if (n == 0 && !format.empty()) fail("strftime_now: format too long or empty result");
  buf.resize(n);
  return buf;
}

Value global_function(std::string_view name) {
  if (name == "raise_exception") {
    return make_function("raise_exception", [](Context&, const CallArgs& a) -> Value {
      const auto v = bind_args("raise_exception", a, {"message"}, {Value()});
      fail(to_str(v[0]));
    });
  }
  if (name == "strftime_now") {
    return make_function("strftime_now", [](Context&, const CallArgs& a) {
      const auto v = bind_args("strftime_now", a, {"format"}, {Value()});
      if (!v[0].is_string()) fail("strftime() argument 1 must be str, not " + type_name(v[0]));
      return Value::string(strftime_now(v[0].as_string()));
    });
  }
  if (name == "range") {
    return make_function("range", [](Context&, const CallArgs& a) {
      if (!a.keyword.empty()) fail("range() takes no keyword arguments");
      if (a.positional.empty() || a.positional.size() > 3)
        fail("range expected at most 3 arguments, got " + std::to_string(a.positional.size()));
      for (const auto& p : a.positional)
        if (!int_like(p)) fail("'" + type_name(p) + "' object cannot be interpreted as an integer");
      int64_t start = 0, stop, step = 1;
      if (a.positional.size() == 1) {
        stop = a.positional[0].as_int();
      } else {
        start = a.positional[0].as_int();
        stop = a.positional[1].as_int();
        if (a.positional.size() == 3) step = a.positional[2].as_int();
      }
      if (step == 0) fail("range() arg 3 must not be zero");
      Value::List items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (items.size() >= 100000) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        items.push_back(Value::integer(i));
      }
      return Value::list(std::move(items), Value::Seq::Range);
    });
  }
  if (name == "namespace" || name == "dict") {
    const std::string fn(name);
    return make_function(fn, [fn](Context&, const CallArgs& a) {
      if (a.positional.size() > 1) fail(fn + "() expected at most 1 positional argument");
      Value::Dict attrs;
      const auto put = [&](const std::string& k, const Value& v) {
        for (auto& [ek, ev] : attrs)
          if (ek == k) {
            ev = v;
            return;
          }
        attrs.emplace_back(k, v);
      };
      if (!a.positional.empty()) {
        const Value& init = a.positional[0];
        if (init.is_dict()) {
          for (const auto& [k, v] : init.as_dict()) put(k, v);
        } else {
          for (const auto& pair : iterate(init)) {
            const std::vector<Value> kv = iterate(pair);
            if (kv.size() != 2) fail(fn + "() sequence element has length " + std::to_string(kv.size()) + "; 2 is required");
            if (!kv[0].is_string()) fail("unsupported: " + fn + "() keys that are not strings");
            put(kv[0].as_string(), kv[1]);
          }
        }
      }
      for (const auto& [k, v] : a.keyword) put(k, v);
      if (fn == "dict") return Value::dict(std::move(attrs));
      auto ns = std::make_shared<Namespace>();
      for (auto& [k, v] : attrs) ns->set(k, std::move(v));
      return Value::object(std::move(ns));
    });
  }
  if (name == "lipsum" || name == "cycler" || name == "joiner") {
    const std::string fn(name);
    return make_function(fn, [fn](Context&, const CallArgs&) -> Value { fail("unsupported global '" + fn + "'"); });
  }
  return Value();
}

}  // namespace strata::text::jinja
