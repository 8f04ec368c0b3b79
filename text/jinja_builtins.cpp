// What the sandboxed environment resolves by name: obj.attr and obj[key] (dict methods before
// keys, the immutable sandbox's refusal of list.append & co.), slices, the builtin tests with
// Jinja 3.1's definitions, and the globals (range, namespace, dict, raise_exception,
// strftime_now). A test or method Python has and this does not is an error when used.
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
  return Value::undefined(in_quotes(object_type_repr(obj)) + " has no attribute '" + name + "'");
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
      check_hashable(v[0]);
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
  if (!is_str && !(obj.is_list() && obj.seq() <= Value::Seq::Range)) fail(in_quotes(type_name(obj)) + " object is not subscriptable");
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
        if (!int_like(p)) fail(in_quotes(type_name(p)) + " object cannot be interpreted as an integer");
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
