// Rendering: scopes as Jinja2 compiles them (a for loop's body gets a fresh scope each iteration,
// so a {% set %} inside it never leaks out; macros and {% generation %} bodies get their own),
// the loop variable, macros, and the expression semantics of the AST nodes. Bounded: output size,
// statement count and macro recursion depth.
#include <algorithm>
#include <unordered_map>

#include "text/jinja_ast.h"

namespace strata::text::jinja {

class Scope {
 public:
  explicit Scope(Scope* parent) : parent_(parent) {}
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent_) {
      const auto it = s->vars_.find(name);
      if (it != s->vars_.end()) return &it->second;
    }
    return nullptr;
  }
  void set(const std::string& name, Value v) { vars_[name] = std::move(v); }

 private:
  Scope* parent_;
  std::unordered_map<std::string, Value> vars_;
};

class Context {
 public:
  Context(const Program& p, const Limits& l, Scope* root, std::string* out)
      : program(p), limits(l), scope(root), root_scope(root), out_(out) {}

  void step() {
    if (++steps_ > limits.max_steps)
      fail("template exceeded " + std::to_string(limits.max_steps) + " steps (a runaway loop?)");
  }
  void write(std::string_view s) {
    if (out_->size() + s.size() > limits.max_output_bytes)
      fail("rendered output exceeds the limit of " + std::to_string(limits.max_output_bytes) + " bytes");
    out_->append(s);
  }
  std::string* swap_output(std::string* out) { return std::exchange(out_, out); }

  const Program& program;
  const Limits& limits;
  Scope* scope;
  Scope* root_scope;
  Value captured;
  int call_depth = 0;

 private:
  std::string* out_;
  int64_t steps_ = 0;
};

namespace {

// Makes `s` the innermost scope for the guard's lifetime.
struct ScopeGuard {
  Context& ctx;
  Scope* saved;
  ScopeGuard(Context& c, Scope* s) : ctx(c), saved(c.scope) { c.scope = s; }
  ~ScopeGuard() { ctx.scope = saved; }
};

[[noreturn]] void raise_at(const Context& ctx, const Pos& pos, const std::string& msg) {
  throw Error(ctx.program.name, pos.line, pos.column, msg);
}

Flow run_body(Context& ctx, const Body& body);

// Python's unpacking of `value` into a tuple target.
void assign(Context& ctx, const Target& t, const Value& value) {
  switch (t.kind) {
    case Target::Kind::Name:
      ctx.scope->set(t.name, value);
      return;
    case Target::Kind::Attr: {
      const Value* ns_value = ctx.scope->find(t.name);
      auto* ns = ns_value ? dynamic_cast<Namespace*>(ns_value->as_object()) : nullptr;
      if (!ns) raise_at(ctx, t.pos, "cannot assign attribute on non-namespace object");
      ns->set(t.attr, value);
      return;
    }
    case Target::Kind::Tuple: {
      std::vector<Value> items;
      try {
        items = iterate(value);
      } catch (const EvalError& e) {
        raise_at(ctx, t.pos, "cannot unpack non-iterable " + type_name(value) + " object");
      }
      if (items.size() != t.items.size()) {
        if (items.size() > t.items.size())
          raise_at(ctx, t.pos, "too many values to unpack (expected " + std::to_string(t.items.size()) + ")");
        raise_at(ctx, t.pos, "not enough values to unpack (expected " + std::to_string(t.items.size()) + ", got " +
                                 std::to_string(items.size()) + ")");
      }
      for (size_t i = 0; i < items.size(); ++i) assign(ctx, t.items[i], items[i]);
      return;
    }
  }
}

// The `loop` variable of a for loop.
class LoopObject : public Object {
 public:
  explicit LoopObject(std::shared_ptr<const std::vector<Value>> items) : items_(std::move(items)) {}
  std::string type_name() const override { return "LoopContext"; }
  void set_index(size_t i) { index_ = i; }

  bool attr(const std::string& name, Value& out) const override {
    const auto n = static_cast<int64_t>(items_->size());
    const auto i = static_cast<int64_t>(index_);
    if (name == "index") out = Value::integer(i + 1);
    else if (name == "index0") out = Value::integer(i);
    else if (name == "revindex") out = Value::integer(n - i);
    else if (name == "revindex0") out = Value::integer(n - i - 1);
    else if (name == "first") out = Value::boolean(i == 0);
    else if (name == "last") out = Value::boolean(i == n - 1);
    else if (name == "length") out = Value::integer(n);
    else if (name == "depth") out = Value::integer(1);
    else if (name == "depth0") out = Value::integer(0);
    else if (name == "previtem") out = i > 0 ? (*items_)[index_ - 1] : Value::undefined("there is no previous item");
    else if (name == "nextitem") out = i + 1 < n ? (*items_)[index_ + 1] : Value::undefined("there is no next item");
    else if (name == "cycle") {
      const size_t idx = index_;
      out = make_function("cycle", [idx](Context&, const CallArgs& a) {
        if (a.positional.empty()) fail("no items for cycling given");
        return a.positional[idx % a.positional.size()];
      });
    } else if (name == "changed") {
      auto self = last_changed_;
      out = make_function("changed", [self](Context&, const CallArgs& a) {
        Value now = Value::tuple(a.positional);
        if (!self->has || !equals(self->value, now)) {
          self->has = true;
          self->value = std::move(now);
          return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    } else {
      return false;
    }
    return true;
  }

 private:
  struct Changed {
    bool has = false;
    Value value;
  };
  std::shared_ptr<const std::vector<Value>> items_;
  size_t index_ = 0;
  std::shared_ptr<Changed> last_changed_ = std::make_shared<Changed>();
};

class MacroObject : public Object {
 public:
  MacroObject(const MacroDef* def, Scope* closure) : def_(def), closure_(closure) {}
  std::string type_name() const override { return "Macro"; }
  bool is_callable() const override { return true; }

  Value call(Context& ctx, const CallArgs& args) const {
    if (ctx.call_depth >= ctx.limits.max_call_depth)
      fail("macro calls nested deeper than " + std::to_string(ctx.limits.max_call_depth) + " (runaway recursion?)");
    const auto& params = def_->params;
    if (args.positional.size() > params.size())
      fail("macro '" + def_->name + "' takes not more than " + std::to_string(params.size()) + " argument(s)");
    Scope scope(closure_);
    ScopeGuard guard(ctx, &scope);
    std::vector<bool> given(params.size(), false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      scope.set(params[i], args.positional[i]);
      given[i] = true;
    }
    for (const auto& [k, v] : args.keyword) {
      const auto it = std::find(params.begin(), params.end(), k);
      if (it == params.end()) fail("macro '" + def_->name + "' got an unexpected keyword argument '" + k + "'");
      const auto i = static_cast<size_t>(it - params.begin());
      if (given[i]) fail("macro '" + def_->name + "' got multiple values for argument '" + k + "'");
      scope.set(k, v);
      given[i] = true;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (given[i]) continue;
      scope.set(params[i], def_->defaults[i] ? def_->defaults[i]->eval(ctx)
                                             : Value::undefined("parameter '" + params[i] + "' was not provided"));
    }
    std::string buf;
    std::string* saved = ctx.swap_output(&buf);
    ++ctx.call_depth;
    try {
      run_body(ctx, def_->body);
    } catch (...) {
      --ctx.call_depth;
      ctx.swap_output(saved);
      throw;
    }
    --ctx.call_depth;
    ctx.swap_output(saved);
    return Value::string(std::move(buf));
  }

 private:
  const MacroDef* def_;
  Scope* closure_;
};

bool compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "notin") return !contains(b, a);
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    const bool ints = a.kind() != Value::Kind::Float && b.kind() != Value::Kind::Float;
    if (ints) {
      const int64_t x = a.as_int(), y = b.as_int();
      return op == "<" ? x < y : op == "<=" ? x <= y : op == ">" ? x > y : x >= y;
    }
    const double x = a.as_double(), y = b.as_double();
    return op == "<" ? x < y : op == "<=" ? x <= y : op == ">" ? x > y : x >= y;
  }
  const bool orderable = (a.is_string() && b.is_string()) ||
                         (a.is_list() && b.is_list() && a.seq() == b.seq() && a.seq() <= Value::Seq::Tuple);
  if (!orderable)
    fail(in_quotes(op) + " not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  if (op == "<") return less(a, b);
  if (op == ">") return less(b, a);
  if (op == "<=") return !less(b, a);
  return !less(a, b);
}

Flow run_stmt(Context& ctx, const Stmt& s) {
  try {
    return s.exec(ctx);
  } catch (const EvalError& e) {
    raise_at(ctx, s.pos, e.message);
  }
}

Flow run_body(Context& ctx, const Body& body) {
  for (const auto& s : body) {
    ctx.step();
    const Flow f = run_stmt(ctx, *s);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

}  // namespace

Value call_value(Context& ctx, const Value& callee, const CallArgs& args) {
  if (callee.is_undefined()) fail_undefined(callee);
  if (auto* f = dynamic_cast<Function*>(callee.as_object())) return f->call(ctx, args);
  if (auto* m = dynamic_cast<MacroObject*>(callee.as_object())) return m->call(ctx, args);
  fail(in_quotes(type_name(callee)) + " object is not callable");
}

// --- expressions ---

Value Expr::eval(Context& ctx) const {
  try {
    return do_eval(ctx);
  } catch (const EvalError& e) {
    raise_at(ctx, pos, e.message);
  }
}

Value Const::do_eval(Context&) const { return value; }

Value Name::do_eval(Context& ctx) const {
  if (const Value* v = ctx.scope->find(name)) return *v;
  Value g = global_function(name);
  if (!g.is_undefined()) return g;
  return Value::undefined(in_quotes(name) + " is undefined");
}

Value ListExpr::do_eval(Context& ctx) const {
  Value::List out;
  out.reserve(items.size());
  for (const auto& e : items) out.push_back(e->eval(ctx));
  return Value::list(std::move(out), tuple ? Value::Seq::Tuple : Value::Seq::List);
}

Value DictExpr::do_eval(Context& ctx) const {
  Value::Dict out;
  for (const auto& [k, v] : items) {
    const Value key = k->eval(ctx);
    check_hashable(key);
    if (!key.is_string()) fail("unsupported: dict keys that are not strings (" + type_name(key) + ")");
    Value val = v->eval(ctx);
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& kv) { return kv.first == key.as_string(); });
    if (it != out.end()) it->second = std::move(val);
    else out.emplace_back(key.as_string(), std::move(val));
  }
  return Value::dict(std::move(out));
}

Value GetAttr::do_eval(Context& ctx) const { return get_attr(obj->eval(ctx), name); }

Value GetItem::do_eval(Context& ctx) const {
  const Value o = obj->eval(ctx);
  return get_item(o, key->eval(ctx));
}

Value SliceExpr::do_eval(Context& ctx) const {
  const Value o = obj->eval(ctx);
  const auto part = [&](const ExprPtr& e) { return e ? e->eval(ctx) : Value::none(); };
  const Value a = part(start), b = part(stop), c = part(step);
  return get_slice(o, a, b, c);
}

CallArgs CallArgsExpr::eval(Context& ctx) const {
  CallArgs out;
  for (const auto& e : positional) out.positional.push_back(e->eval(ctx));
  for (const auto& [k, e] : keyword) out.keyword.emplace_back(k, e->eval(ctx));
  return out;
}

Value Call::do_eval(Context& ctx) const {
  const Value f = callee->eval(ctx);
  const CallArgs a = args.eval(ctx);
  return call_value(ctx, f, a);
}

Value FilterExpr::do_eval(Context& ctx) const {
  const Value v = value->eval(ctx);
  const CallArgs a = args.eval(ctx);
  return call_filter(ctx, name, v, a);
}

Value TestExpr::do_eval(Context& ctx) const {
  const Value v = value->eval(ctx);
  const CallArgs a = args.eval(ctx);
  return Value::boolean(call_test(ctx, name, v, a) != negated);
}

Value Captured::do_eval(Context& ctx) const { return ctx.captured; }

Value Unary::do_eval(Context& ctx) const {
  const Value v = operand->eval(ctx);
  if (op == '!') return Value::boolean(!truthy(v));
  if (op == '-') return negate(v);
  return unary_plus(v);
}

Value Binary::do_eval(Context& ctx) const {
  const Value a = left->eval(ctx);
  const Value b = right->eval(ctx);
  return binary_op(op, a, b);
}

Value Logic::do_eval(Context& ctx) const {
  Value a = left->eval(ctx);
  if (truthy(a) != is_and) return a;  // and: a falsy -> a; or: a truthy -> a
  return right->eval(ctx);
}

Value Concat::do_eval(Context& ctx) const {
  std::string out;
  for (const auto& p : parts) {
    out += to_str(p->eval(ctx));
    if (out.size() > kMaxValueBytes) fail("string exceeds the size limit");
  }
  return Value::string(std::move(out));
}

Value Compare::do_eval(Context& ctx) const {
  Value a = first->eval(ctx);
  for (const auto& [op, e] : rest) {
    Value b = e->eval(ctx);
    if (!compare(op, a, b)) return Value::boolean(false);
    a = std::move(b);
  }
  return Value::boolean(true);
}

Value CondExpr::do_eval(Context& ctx) const {
  if (truthy(test->eval(ctx))) return then->eval(ctx);
  if (otherwise) return otherwise->eval(ctx);
  return Value::undefined("the inline if-expression on line " + std::to_string(pos.line) +
                          " evaluated to false and no else section was defined.");
}

// --- statements ---

Flow Text::exec(Context& ctx) const {
  ctx.write(text);
  return Flow::Normal;
}

Flow Print::exec(Context& ctx) const {
  const Value v = expr->eval(ctx);
  try {
    ctx.write(to_str(v));
  } catch (const EvalError& e) {
    raise_at(ctx, expr->pos, e.message);
  }
  return Flow::Normal;
}

Flow If::exec(Context& ctx) const {
  for (const auto& [test, body] : branches)
    if (truthy(test->eval(ctx))) return run_body(ctx, body);
  return run_body(ctx, otherwise);
}

Flow For::exec(Context& ctx) const {
  const Value seq = iter->eval(ctx);
  std::vector<Value> items;
  try {
    items = iterate(seq);
  } catch (const EvalError& e) {
    raise_at(ctx, iter->pos, e.message);
  }
  if (filter) {
    std::vector<Value> kept;
    for (auto& item : items) {
      ctx.step();
      Scope scope(ctx.scope);
      ScopeGuard guard(ctx, &scope);
      assign(ctx, target, item);
      if (truthy(filter->eval(ctx))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) return run_body(ctx, otherwise);
  auto shared = std::make_shared<const std::vector<Value>>(std::move(items));
  auto loop = std::make_shared<LoopObject>(shared);
  const Value loop_value = Value::object(loop);
  for (size_t i = 0; i < shared->size(); ++i) {
    ctx.step();
    Scope scope(ctx.scope);
    ScopeGuard guard(ctx, &scope);
    loop->set_index(i);
    assign(ctx, target, (*shared)[i]);
    scope.set("loop", loop_value);
    if (run_body(ctx, body) == Flow::Break) break;
  }
  return Flow::Normal;
}

Flow Assign::exec(Context& ctx) const {
  assign(ctx, target, value->eval(ctx));
  return Flow::Normal;
}

Flow AssignBlock::exec(Context& ctx) const {
  std::string buf;
  Flow flow;
  {
    Scope scope(ctx.scope);
    ScopeGuard guard(ctx, &scope);
    std::string* saved = ctx.swap_output(&buf);
    try {
      flow = run_body(ctx, body);
    } catch (...) {
      ctx.swap_output(saved);
      throw;
    }
    ctx.swap_output(saved);
  }
  Value v = Value::string(std::move(buf));
  if (filter) {
    ctx.captured = std::move(v);
    v = filter->eval(ctx);
  }
  assign(ctx, target, v);
  return flow;
}

Flow MacroDef::exec(Context& ctx) const {
  ctx.scope->set(name, Value::object(std::make_shared<MacroObject>(this, ctx.root_scope)));
  return Flow::Normal;
}

Flow LoopControl::exec(Context&) const { return is_break ? Flow::Break : Flow::Continue; }

Flow ScopedBlock::exec(Context& ctx) const {
  Scope scope(ctx.scope);
  ScopeGuard guard(ctx, &scope);
  return run_body(ctx, body);
}

// --- Template ---

Template Template::parse(std::string_view source, std::string name) {
  Template t;
  t.program_ = parse_program(source, name);
  return t;
}

const std::string& Template::name() const { return program_->name; }

std::string Template::render(const Value& context, const Limits& limits) const {
  if (!context.is_dict()) throw std::invalid_argument("Template::render: the context must be a dict, not " + type_name(context));
  Scope root(nullptr);
  for (const auto& [k, v] : context.as_dict()) root.set(k, v);
  std::string out;
  Context ctx(*program_, limits, &root, &out);
  try {
    run_body(ctx, program_->body);
  } catch (const EvalError& e) {
    throw Error(program_->name, 1, 1, e.message);
  }
  return out;
}

}  // namespace strata::text::jinja
