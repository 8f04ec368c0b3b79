// Python's str methods as templates call them (message.content.strip(), .split('</think>'),
// .startswith(...), ...) on code points, and str.format through the sandbox's formatter. A str
// method that exists in Python but not here is an error, never a silent difference.
#include <algorithm>
#include <cstring>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

namespace {

bool int_like(const Value& v) { return v.kind() == Value::Kind::Bool || v.kind() == Value::Kind::Int; }

[[noreturn]] void fail_not_int(const Value& v) {
  std::string m = "'";
  m += type_name(v);
  m += "' object cannot be interpreted as an integer";
  fail(std::move(m));
}

const std::string& need_str(const Value& v, const std::string& what) {
  if (!v.is_string()) fail(what + " must be str, not " + type_name(v));
  return v.as_string();
}

// start/end arguments of find/count/startswith: Python slice indices on code points.
void clamp_range(const Value& start_v, const Value& end_v, int64_t len, int64_t& start, int64_t& end) {
  const auto idx = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    if (!int_like(v)) fail("slice indices must be integers or None or have an __index__ method");
    int64_t i = v.as_int();
    if (i < 0) i = std::max<int64_t>(0, i + len);
    return std::min(i, len);
  };
  start = idx(start_v, 0);
  end = idx(end_v, len);
}

int64_t find_cp(const std::vector<char32_t>& hay, const std::vector<char32_t>& needle, int64_t start, int64_t end, bool reverse) {
  const int64_t n = static_cast<int64_t>(needle.size());
  if (end - start < n) return -1;
  const auto match = [&](int64_t i) { return std::equal(needle.begin(), needle.end(), hay.begin() + i); };
  if (reverse) {
    for (int64_t i = end - n; i >= start; --i)
      if (match(i)) return i;
  } else {
    for (int64_t i = start; i + n <= end; ++i)
      if (match(i)) return i;
  }
  return -1;
}

Value list_of(std::vector<std::string> parts) {
  Value::List items;
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::list(std::move(items));
}

// str.split / str.rsplit
Value split(const std::string& s, const Value& sep_v, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep_v.is_none()) {  // runs of whitespace, no empty strings
    std::vector<char32_t> cps = utf8_decode(s);
    if (from_right) std::reverse(cps.begin(), cps.end());
    size_t i = 0;
    int64_t splits = 0;
    while (true) {
      while (i < cps.size() && py_isspace(cps[i])) ++i;
      if (i >= cps.size()) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        size_t e = cps.size();
        while (e > i && py_isspace(cps[e - 1])) --e;
        std::vector<char32_t> rest(cps.begin() + static_cast<std::ptrdiff_t>(i), cps.begin() + static_cast<std::ptrdiff_t>(e));
        if (from_right) std::reverse(rest.begin(), rest.end());
        parts.push_back(utf8_encode(rest));
        break;
      }
      size_t j = i;
      while (j < cps.size() && !py_isspace(cps[j])) ++j;
      std::vector<char32_t> word(cps.begin() + static_cast<std::ptrdiff_t>(i), cps.begin() + static_cast<std::ptrdiff_t>(j));
      if (from_right) std::reverse(word.begin(), word.end());
      parts.push_back(utf8_encode(word));
      ++splits;
      i = j;
    }
    if (from_right) std::reverse(parts.begin(), parts.end());
    return list_of(std::move(parts));
  }
  const std::string& sep = need_str(sep_v, "sep");
  if (sep.empty()) fail("empty separator");
  if (!from_right) {
    size_t start = 0;
    int64_t splits = 0;
    while (maxsplit < 0 || splits < maxsplit) {
      const size_t p = s.find(sep, start);
      if (p == std::string::npos) break;
      parts.push_back(s.substr(start, p - start));
      start = p + sep.size();
      ++splits;
    }
    parts.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    int64_t splits = 0;
    while (maxsplit < 0 || splits < maxsplit) {
      if (end < sep.size()) break;
      const size_t p = s.rfind(sep, end - sep.size());
      if (p == std::string::npos) break;
      parts.push_back(s.substr(p + sep.size(), end - p - sep.size()));
      end = p;
      ++splits;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  return list_of(std::move(parts));
}

std::string replace(const std::string& s, const std::string& old, const std::string& neu, int64_t count) {
  std::string out;
  if (old.empty()) {  // new goes before every code point and at the end
    const std::vector<char32_t> cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += neu;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += neu;
    if (out.size() > kMaxValueBytes) fail("string exceeds the size limit");
    start = p + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

bool starts_or_ends(const std::string& s, const Value& affix, const Value& start_v, const Value& end_v, bool ends, const char* fn) {
  // The usual call, s.startswith('<think>'): on UTF-8 a code-point prefix is a byte prefix, so no
  // decoding is needed without start/end.
  if (start_v.is_none() && end_v.is_none() && affix.is_string()) {
    const std::string& a = affix.as_string();
    if (a.size() > s.size()) return false;
    return s.compare(ends ? s.size() - a.size() : 0, a.size(), a) == 0;
  }
  const std::vector<char32_t> cps = utf8_decode(s);
  int64_t start, end;
  clamp_range(start_v, end_v, static_cast<int64_t>(cps.size()), start, end);
  std::vector<Value> options;
  if (affix.is_string()) {
    options.push_back(affix);
  } else if (affix.is_list() && affix.seq() == Value::Seq::Tuple) {
    options = affix.as_list();
  } else {
    fail(std::string(fn) + " first arg must be str or a tuple of str, not " + type_name(affix));
  }
  for (const auto& o : options) {
    if (!o.is_string()) fail("tuple for " + std::string(fn) + " must only contain str, not " + type_name(o));
    const std::vector<char32_t> a = utf8_decode(o.as_string());
    const int64_t n = static_cast<int64_t>(a.size());
    if (end - start < n) continue;
    const int64_t at = ends ? end - n : start;
    if (std::equal(a.begin(), a.end(), cps.begin() + at)) return true;
  }
  return false;
}

template <class Pred>
bool all_cps(const std::string& s, Pred pred) {
  const std::vector<char32_t> cps = utf8_decode(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), pred);
}

std::string pad(const std::string& s, const Value& width_v, const Value& fill_v, char how) {
  if (!int_like(width_v)) fail_not_int(width_v);
  const std::vector<char32_t> fill = utf8_decode(need_str(fill_v, "fillchar"));
  if (fill.size() != 1) fail("The fill character must be exactly one character long");
  const int64_t len = static_cast<int64_t>(utf8_length(s));
  const int64_t width = width_v.as_int();
  if (width <= len) return s;
  if (width > static_cast<int64_t>(kMaxValueBytes)) fail("string exceeds the size limit");
  const int64_t total = width - len;
  int64_t left = how == 'l' ? 0 : how == 'r' ? total : total / 2 + (total & width & 1);
  std::string f;
  utf8_append(f, fill[0]);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += f;
  out += s;
  for (int64_t i = 0; i < total - left; ++i) out += f;
  return out;
}

bool is_python_str_method(const std::string& name) {
  static const char* const kNames[] = {
      "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format", "format_map",
      "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric",
      "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip", "maketrans", "partition",
      "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip", "split",
      "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper", "zfill"};
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

Value call_str_method(const std::string& name, const std::string& s, const CallArgs& a) {
  const auto bind = [&](const std::vector<std::string_view>& params, const std::vector<Value>& defaults) {
    return bind_args(name, a, params, defaults);
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const auto v = bind({"chars"}, {Value::none()});
    return Value::string(py_strip(s, v[0], name != "rstrip", name != "lstrip"));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize" || name == "casefold") {
    bind({}, {});
    if (name == "upper") return Value::string(py_upper(s));
    if (name == "lower" || name == "casefold") return Value::string(py_lower(s));
    if (name == "title") return Value::string(py_title(s));
    return Value::string(py_capitalize(s));
  }
  if (name == "startswith" || name == "endswith") {
    const auto v = bind({"prefix", "start", "end"}, {Value(), Value::none(), Value::none()});
    return Value::boolean(starts_or_ends(s, v[0], v[1], v[2], name == "endswith", name.c_str()));
  }
  if (name == "split" || name == "rsplit") {
    const auto v = bind({"sep", "maxsplit"}, {Value::none(), Value::integer(-1)});
    if (!int_like(v[1])) fail_not_int(v[1]);
    return split(s, v[0], v[1].as_int(), name == "rsplit");
  }
  if (name == "splitlines") {
    const auto v = bind({"keepends"}, {Value::boolean(false)});
    return list_of(py_splitlines(s, truthy(v[0])));
  }
  if (name == "replace") {
    const auto v = bind({"old", "new", "count"}, {Value(), Value(), Value::integer(-1)});
    if (!int_like(v[2])) fail_not_int(v[2]);
    return make_string_checked(replace(s, need_str(v[0], "replace() argument 1"), need_str(v[1], "replace() argument 2"), v[2].as_int()));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    const auto v = bind({"sub", "start", "end"}, {Value(), Value::none(), Value::none()});
    const std::vector<char32_t> cps = utf8_decode(s);
    const std::vector<char32_t> sub = utf8_decode(need_str(v[0], "must be str"));
    int64_t start, end;
    clamp_range(v[1], v[2], static_cast<int64_t>(cps.size()), start, end);
    if (name == "count") {
      if (start > end) return Value::integer(0);
      if (sub.empty()) return Value::integer(end - start + 1);
      int64_t n = 0;
      for (int64_t i = start; (i = find_cp(cps, sub, i, end, false)) >= 0; i += static_cast<int64_t>(sub.size())) ++n;
      return Value::integer(n);
    }
    const int64_t at = find_cp(cps, sub, start, end, name[0] == 'r');
    if (at < 0 && (name == "index" || name == "rindex")) fail("substring not found");
    return Value::integer(at);
  }
  if (name == "join") {
    const auto v = bind({"iterable"}, {Value()});
    std::string out;
    size_t i = 0;
    for (const auto& item : iterate(v[0])) {
      if (!item.is_string())
        fail("sequence item " + std::to_string(i) + ": expected str instance, " + type_name(item) + " found");
      if (i++) out += s;
      out += item.as_string();
      if (out.size() > kMaxValueBytes) fail("string exceeds the size limit");
    }
    return Value::string(std::move(out));
  }
  if (name == "format") return Value::string(py_format(s, a));
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric" || name == "isalpha" || name == "isalnum" ||
      name == "isspace" || name == "isascii") {
    bind({}, {});
    if (name == "isascii") return Value::boolean(std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }));
    if (name == "isdigit") return Value::boolean(all_cps(s, py_isdigit));
    if (name == "isdecimal") return Value::boolean(all_cps(s, py_isdecimal));
    if (name == "isnumeric") return Value::boolean(all_cps(s, py_isnumeric));
    if (name == "isalpha") return Value::boolean(all_cps(s, py_isalpha));
    if (name == "isspace") return Value::boolean(all_cps(s, py_isspace));
    return Value::boolean(all_cps(s, [](char32_t c) { return py_isalpha(c) || py_isnumeric(c); }));
  }
  if (name == "islower" || name == "isupper") {
    bind({}, {});
    bool cased = false;
    for (char32_t c : utf8_decode(s)) {
      const bool lo = py_islower_cp(c), up = py_isupper_cp(c), ti = py_istitle_cp(c);
      if (name == "islower" ? (up || ti) : (lo || ti)) return Value::boolean(false);
      if (name == "islower" ? lo : up) cased = true;
    }
    return Value::boolean(cased);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    const auto v = bind({"affix"}, {Value()});
    const std::string& x = need_str(v[0], name + "() argument");
    if (name == "removeprefix") return Value::string(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
    const bool ends = s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
    return Value::string(ends ? s.substr(0, s.size() - x.size()) : s);
  }
  if (name == "partition" || name == "rpartition") {
    const auto v = bind({"sep"}, {Value()});
    const std::string& sep = need_str(v[0], "sep");
    if (sep.empty()) fail("empty separator");
    const size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (p == std::string::npos) {
      if (name == "partition") return Value::tuple({Value::string(s), Value::string(""), Value::string("")});
      return Value::tuple({Value::string(""), Value::string(""), Value::string(s)});
    }
    return Value::tuple({Value::string(s.substr(0, p)), Value::string(sep), Value::string(s.substr(p + sep.size()))});
  }
  if (name == "ljust" || name == "rjust" || name == "center") {
    const auto v = bind({"width", "fillchar"}, {Value(), Value::string(" ")});
    return Value::string(pad(s, v[0], v[1], name == "ljust" ? 'l' : name == "rjust" ? 'r' : 'c'));
  }
  if (name == "zfill") {
    const auto v = bind({"width"}, {Value()});
    if (!int_like(v[0])) fail_not_int(v[0]);
    const int64_t len = static_cast<int64_t>(utf8_length(s));
    if (v[0].as_int() <= len) return Value::string(s);
    if (v[0].as_int() > static_cast<int64_t>(kMaxValueBytes)) fail("string exceeds the size limit");
    const std::string zeros(static_cast<size_t>(v[0].as_int() - len), '0');
    if (!s.empty() && (s[0] == '+' || s[0] == '-')) return Value::string(s.substr(0, 1) + zeros + s.substr(1));
    return Value::string(zeros + s);
  }
  fail("unsupported string method '" + name + "'");
}

bool implemented(const std::string& name) {
  static const char* const kNames[] = {
      "strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "casefold", "startswith", "endswith", "split",
      "rsplit", "splitlines", "replace", "find", "rfind", "index", "rindex", "count", "join", "format", "isdigit",
      "isdecimal", "isnumeric", "isalpha", "isalnum", "isspace", "isascii", "islower", "isupper", "removeprefix",
      "removesuffix", "partition", "rpartition", "ljust", "rjust", "center", "zfill"};
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

}  // namespace

Value string_method(const Value& s, const std::string& name) {
  if (!is_python_str_method(name)) return Value();
  if (!implemented(name)) fail("unsupported string method '" + name + "'");
  if (s.is_markup()) fail("unsupported: string method '" + name + "' on a |safe string");
  const std::string str = s.as_string();
  return make_function(name, [str, name](Context&, const CallArgs& a) { return call_str_method(name, str, a); });
}

std::string py_format(const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  bool used_auto = false, used_manual = false;
  for (size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out.push_back('}');
        ++i;
        continue;
      }
      fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    const size_t close = fmt.find('}', i);
    if (close == std::string::npos) fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    if (field.find('{') != std::string::npos) fail("unsupported: nested fields in str.format");
    char conv = 0;
    const size_t colon = field.find(':');
    if (colon != std::string::npos) {
      if (colon + 1 < field.size()) fail("unsupported: format spec '" + field.substr(colon + 1) + "' in str.format");
      field.resize(colon);
    }
    const size_t bang = field.find('!');
    if (bang != std::string::npos) {
      if (bang + 2 != field.size() || !std::strchr("rsa", field[bang + 1])) fail("invalid conversion in format string");
      conv = field[bang + 1];
      field.resize(bang);
    }
    if (field.find_first_of(".[") != std::string::npos) fail("unsupported: attribute or index access in str.format fields");
    Value v;
    if (field.empty()) {
      if (used_manual) fail("cannot switch from manual field specification to automatic field numbering");
      used_auto = true;
      if (auto_index >= args.positional.size())
        fail("Replacement index " + std::to_string(auto_index) + " out of range for positional args tuple");
      v = args.positional[auto_index++];
    } else if (std::all_of(field.begin(), field.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
      if (used_auto) fail("cannot switch from automatic field numbering to manual field specification");
      used_manual = true;
      const size_t idx = std::stoul(field);
      if (idx >= args.positional.size()) fail("Replacement index " + field + " out of range for positional args tuple");
      v = args.positional[idx];
    } else {
      const auto it = std::find_if(args.keyword.begin(), args.keyword.end(), [&](const auto& kv) { return kv.first == field; });
      if (it == args.keyword.end()) fail(in_quotes(field));
      v = it->second;
    }
    if (conv == 'r' || conv == 'a') {
      if (conv == 'a') fail("unsupported: !a conversion in str.format");
      out += repr(v);
    } else {
      out += to_str(v);
    }
    if (out.size() > kMaxValueBytes) fail("string exceeds the size limit");
  }
  return out;
}

}  // namespace strata::text::jinja
