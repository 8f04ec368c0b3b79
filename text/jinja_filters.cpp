// The builtin filters with Jinja 3.1's definitions (jinja2/filters.py) on Python semantics,
// including what they return: select/map/unique/items give single-use generators, reverse a
// reverse iterator, as in Python. A filter Jinja has and this does not is an error when used.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

namespace {

bool int_like(const Value& v) { return v.kind() == Value::Kind::Bool || v.kind() == Value::Kind::Int; }

}  // namespace

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
  if (!int_like(precision_v)) fail(in_quotes(type_name(precision_v)) + " object cannot be interpreted as an integer");
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
    if (value.kind() == Value::Kind::Object) fail(in_quotes(type_name(value)) + " object is not reversible");
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
      check_hashable(key);
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
    if (!value.is_dict()) fail(in_quotes(type_name(value)) + " object has no attribute 'items'");
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

}  // namespace strata::text::jinja
