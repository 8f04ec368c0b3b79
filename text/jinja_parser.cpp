// Jinja2's parser (jinja2/parser.py) for the statements chat templates use: for (with else,
// a loop filter and tuple targets), if/elif/else, set (name, tuple, ns.attr, block set with
// filters), macro, break/continue (loopcontrols) and {% generation %} (transformers'
// AssistantTracker). The expression grammar and its precedence follow parse_condexpr ...
// parse_unary exactly, including the Jinja-specific ones (filters bind tighter than any binary
// operator, ** is left-associative, unary minus binds tighter than **).
#include <algorithm>

#include "text/jinja_ast.h"
#include "text/jinja_lexer.h"

namespace strata::text::jinja {

namespace {

template <class T>
std::unique_ptr<T> node(const Token& at) {
  auto n = std::make_unique<T>();
  n->pos = Pos{at.line, at.column};
  return n;
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name) : toks_(std::move(tokens)), name_(name) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != Tok::Eof) error(cur(), "unexpected '" + cur().text + "'");
    return body;
  }

 private:
  // --- token stream ---
  const Token& cur() const { return toks_[i_]; }
  const Token& peek(size_t n = 1) const { return toks_[std::min(i_ + n, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  bool at_op(std::string_view op) const { return cur().type == Tok::Op && cur().text == op; }
  bool at_name(std::string_view n) const { return cur().type == Tok::Name && cur().text == n; }

  [[noreturn]] void error(const Token& at, const std::string& msg) const { throw Error(name_, at.line, at.column, msg); }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Data: return "template data";
      case Tok::VarBegin: return "begin of print statement";
      case Tok::VarEnd: return "end of print statement";
      case Tok::BlockBegin: return "begin of statement block";
      case Tok::BlockEnd: return "end of statement block";
      case Tok::Eof: return "end of template";
      case Tok::String: return "string";
      default: return in_quotes(t.text);
    }
  }

  void expect_op(std::string_view op) {
    if (!at_op(op)) error(cur(), "expected '" + std::string(op) + "', got " + describe(cur()));
    next();
  }
  const Token& expect_name() {
    if (cur().type != Tok::Name) error(cur(), "expected a name, got " + describe(cur()));
    return next();
  }
  void expect_name(std::string_view n) {
    if (!at_name(n)) error(cur(), "expected '" + std::string(n) + "', got " + describe(cur()));
    next();
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) error(cur(), "expected end of statement block, got " + describe(cur()));
    next();
  }

  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser, const Token& at) : p(parser) {
      if (++p.depth_ > kMaxNestingDepth) p.error(at, "template nested too deeply (more than " + std::to_string(kMaxNestingDepth) + " levels)");
    }
    ~DepthGuard() { --p.depth_; }
  };

  // --- statements ---

  // Nodes until a {% tag %} whose name is in `end_tags`; leaves the stream at that name.
  Body subparse(const std::vector<std::string>& end_tags) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::Data) {
        auto n = node<Text>(t);
        n->text = t.text;
        body.push_back(std::move(n));
        next();
      } else if (t.type == Tok::VarBegin) {
        next();
        auto n = node<Print>(t);
        n->expr = parse_tuple(false, true, {}, false);
        if (cur().type != Tok::VarEnd) error(cur(), "expected end of print statement, got " + describe(cur()));
        next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::BlockBegin) {
        const Token& tag = peek();
        if (tag.type == Tok::Name && std::find(end_tags.begin(), end_tags.end(), tag.text) != end_tags.end()) {
          next();
          return body;
        }
        next();
        body.push_back(parse_statement());
      } else if (t.type == Tok::Eof) {
        if (!end_tags.empty()) {
          std::string want;
          for (const auto& e : end_tags) want += (want.empty() ? "'" : " or '") + e + "'";
          error(t, "unexpected end of template, expected " + want);
        }
        return body;
      } else {
        error(t, "unexpected " + describe(t));
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& tag = cur();
    if (tag.type != Tok::Name) error(tag, "tag name expected");
    DepthGuard guard(*this, tag);
    const std::string& n = tag.text;
    if (n == "for") return parse_for();
    if (n == "if") return parse_if();
    if (n == "set") return parse_set();
    if (n == "macro") return parse_macro();
    if (n == "break" || n == "continue") {
      if (loop_depth_ == 0) error(tag, in_quotes(n) + " outside of a loop");
      auto s = node<LoopControl>(tag);
      s->is_break = n == "break";
      next();
      expect_block_end();
      return s;
    }
    if (n == "generation") {
      auto s = node<ScopedBlock>(tag);
      next();
      expect_block_end();
      const int saved = loop_depth_;
      loop_depth_ = 0;  // the body is a function in Python: no break/continue across it
      ++block_depth_;
      s->body = subparse({"endgeneration"});
      --block_depth_;
      loop_depth_ = saved;
      next();
      expect_block_end();
      return s;
    }
    static const char* const kKnown[] = {"block", "extends", "include", "import", "from", "call", "filter",
                                         "with", "autoescape", "raw", "trans", "do", "print"};
    for (const char* k : kKnown)
      if (n == k) error(tag, "unsupported tag '" + n + "'");
    static const char* const kEnd[] = {"endfor", "endif", "endset", "endmacro", "endgeneration", "else", "elif",
                                       "endblock", "endcall", "endfilter", "endwith", "endraw"};
    for (const char* k : kEnd)
      if (n == k) error(tag, "unexpected '" + n + "'");
    error(tag, "unknown tag '" + n + "'");
  }

  StmtPtr parse_for() {
    auto s = node<For>(next());
    s->target = parse_target(false, {"in"});
    expect_name("in");
    s->iter = parse_tuple(false, false, {"recursive"}, false);
    if (at_name("if")) {
      next();
      s->filter = parse_expression(true);
    }
    if (at_name("recursive")) error(cur(), "unsupported: recursive for loops");
    expect_block_end();
    ++loop_depth_;
    ++block_depth_;
    s->body = subparse({"endfor", "else"});
    --loop_depth_;
    if (next().text == "else") {
      expect_block_end();
      s->otherwise = subparse({"endfor"});
      next();
    }
    --block_depth_;
    expect_block_end();
    return s;
  }

  StmtPtr parse_if() {
    auto s = node<If>(next());
    ExprPtr test = parse_tuple(false, false, {}, false);
    expect_block_end();
    Body body = subparse({"elif", "else", "endif"});
    s->branches.emplace_back(std::move(test), std::move(body));
    while (true) {
      const std::string tag = next().text;
      if (tag == "elif") {
        ExprPtr t = parse_tuple(false, false, {}, false);
        expect_block_end();
        Body b = subparse({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(t), std::move(b));
      } else if (tag == "else") {
        expect_block_end();
        s->otherwise = subparse({"endif"});
        next();
        expect_block_end();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  StmtPtr parse_set() {
    const Token& at = next();
    Target target = parse_target(true, {});
    if (at_op("=")) {
      next();
      auto s = node<Assign>(at);
      s->target = std::move(target);
      s->value = parse_tuple(false, true, {}, false);
      expect_block_end();
      return s;
    }
    auto s = node<AssignBlock>(at);
    s->target = std::move(target);
    if (at_op("|")) {
      auto captured = node<Captured>(cur());
      s->filter = parse_filters(std::move(captured));
    }
    expect_block_end();
    ++block_depth_;
    s->body = subparse({"endset"});
    --block_depth_;
    next();
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro() {
    // A macro closes over the template's top-level variables here; one defined inside a block
    // would see that block's variables in Python.
    if (block_depth_ > 0) error(cur(), "unsupported: a macro defined inside a for loop, macro, block set or generation block");
    auto s = node<MacroDef>(next());
    s->name = expect_name().text;
    expect_op("(");
    while (!at_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (at_op(")")) break;
      s->params.push_back(expect_name().text);
      if (at_op("=")) {
        next();
        s->defaults.push_back(parse_expression(true));
      } else {
        if (!s->defaults.empty() && s->defaults.back()) error(cur(), "non-default argument follows default argument");
        s->defaults.push_back(nullptr);
      }
    }
    next();
    expect_block_end();
    const int saved = loop_depth_;
    loop_depth_ = 0;
    ++macro_depth_;
    ++block_depth_;
    s->body = subparse({"endmacro"});
    --block_depth_;
    --macro_depth_;
    loop_depth_ = saved;
    next();
    expect_block_end();
    return s;
  }

  // A name, ns.attr (when with_namespace), or a tuple of names/parenthesized tuples.
  Target parse_target(bool with_namespace, const std::vector<std::string>& extra_end) {
    if (with_namespace && cur().type == Tok::Name && peek().type == Tok::Op && peek().text == ".") {
      Target t;
      t.kind = Target::Kind::Attr;
      t.pos = Pos{cur().line, cur().column};
      t.name = next().text;
      next();
      t.attr = expect_name().text;
      return t;
    }
    Target tuple;
    tuple.kind = Target::Kind::Tuple;
    tuple.pos = Pos{cur().line, cur().column};
    bool is_tuple = false;
    while (true) {
      if (!tuple.items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      tuple.items.push_back(parse_target_primary());
      if (at_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (tuple.items.empty()) error(cur(), "expected an assignment target, got " + describe(cur()));
      return std::move(tuple.items[0]);
    }
    return tuple;
  }

  Target parse_target_primary() {
    const Token& t = cur();
    if (t.type == Tok::Name) {
      if (t.text == "true" || t.text == "false" || t.text == "none" || t.text == "True" || t.text == "False" || t.text == "None")
        error(t, "can't assign to '" + t.text + "'");
      Target n;
      n.pos = Pos{t.line, t.column};
      n.name = next().text;
      return n;
    }
    if (at_op("(")) {
      DepthGuard guard(*this, t);
      next();
      Target inner = parse_target(false, {});
      expect_op(")");
      return inner;
    }
    error(t, "can't assign to " + describe(t));
  }

  bool is_tuple_end(const std::vector<std::string>& extra_end) const {
    if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || at_op(")")) return true;
    return cur().type == Tok::Name && std::find(extra_end.begin(), extra_end.end(), cur().text) != extra_end.end();
  }

  // --- expressions ---

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string>& extra_end, bool explicit_parens) {
    const Token& start = cur();
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (at_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) error(cur(), "expected an expression, got " + describe(cur()));
    }
    auto t = node<ListExpr>(start);
    t->tuple = true;
    t->items = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }

  ExprPtr parse_condexpr() {
    const Token& start = cur();
    ExprPtr expr = parse_or();
    while (at_name("if")) {
      next();
      auto c = node<CondExpr>(start);
      c->test = parse_or();
      if (at_name("else")) {
        next();
        c->otherwise = parse_condexpr();
      }
      c->then = std::move(expr);
      expr = std::move(c);
    }
    return expr;
  }

  ExprPtr logic(ExprPtr left, const Token& at, bool is_and, ExprPtr right) {
    auto l = node<Logic>(at);
    l->is_and = is_and;
    l->left = std::move(left);
    l->right = std::move(right);
    return l;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      const Token& at = next();
      left = logic(std::move(left), at, false, parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      const Token& at = next();
      left = logic(std::move(left), at, true, parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      const Token& at = next();
      DepthGuard guard(*this, at);
      auto u = node<Unary>(at);
      u->op = '!';
      u->operand = parse_not();
      return u;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& start = cur();
    ExprPtr first = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> rest;
    while (true) {
      if (cur().type == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        const std::string op = next().text;
        rest.emplace_back(op, parse_math1());
      } else if (at_name("in")) {
        next();
        rest.emplace_back("in", parse_math1());
      } else if (at_name("not") && peek().type == Tok::Name && peek().text == "in") {
        next();
        next();
        rest.emplace_back("notin", parse_math1());
      } else {
        break;
      }
    }
    if (rest.empty()) return first;
    auto c = node<Compare>(start);
    c->first = std::move(first);
    c->rest = std::move(rest);
    return c;
  }

  ExprPtr binary(BinOp op, const Token& at, ExprPtr left, ExprPtr right) {
    auto b = node<Binary>(at);
    b->op = op;
    b->left = std::move(left);
    b->right = std::move(right);
    return b;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      const Token& at = next();
      left = binary(at.text == "+" ? BinOp::Add : BinOp::Sub, at, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    const Token& start = cur();
    ExprPtr first = parse_math2();
    if (!at_op("~")) return first;
    auto c = node<Concat>(start);
    c->parts.push_back(std::move(first));
    while (at_op("~")) {
      next();
      c->parts.push_back(parse_math2());
    }
    return c;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& at = next();
      const BinOp op = at.text == "*" ? BinOp::Mul : at.text == "/" ? BinOp::Div : at.text == "//" ? BinOp::FloorDiv : BinOp::Mod;
      left = binary(op, at, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (at_op("**")) {
      const Token& at = next();
      left = binary(BinOp::Pow, at, std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Token& at = cur();
    DepthGuard guard(*this, at);
    ExprPtr n;
    if (at_op("-") || at_op("+")) {
      next();
      auto u = node<Unary>(at);
      u->op = at.text[0];
      u->operand = parse_unary(false);
      n = std::move(u);
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    DepthGuard guard(*this, t);
    switch (t.type) {
      case Tok::Name: {
        next();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto c = node<Const>(t);
          c->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
          return c;
        }
        if (t.text == "none" || t.text == "None") {
          auto c = node<Const>(t);
          c->value = Value::none();
          return c;
        }
        if (macro_depth_ > 0 && (t.text == "varargs" || t.text == "kwargs" || t.text == "caller"))
          error(t, "unsupported: '" + t.text + "' in a macro");
        auto n = node<Name>(t);
        n->name = t.text;
        return n;
      }
      case Tok::String: {
        std::string s;
        while (cur().type == Tok::String) s += next().text;  // adjacent literals concatenate
        auto c = node<Const>(t);
        c->value = Value::string(std::move(s));
        return c;
      }
      case Tok::Int: {
        next();
        auto c = node<Const>(t);
        c->value = Value::integer(t.int_value);
        return c;
      }
      case Tok::Float: {
        next();
        auto c = node<Const>(t);
        c->value = Value::number(t.float_value);
        return c;
      }
      case Tok::Op:
        if (t.text == "(") {
          next();
          ExprPtr e = parse_tuple(false, true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default: break;
    }
    error(t, "unexpected " + describe(t));
  }

  ExprPtr parse_list() {
    auto l = node<ListExpr>(next());
    while (!at_op("]")) {
      if (!l->items.empty()) expect_op(",");
      if (at_op("]")) break;
      l->items.push_back(parse_expression(true));
    }
    next();
    return l;
  }

  ExprPtr parse_dict() {
    auto d = node<DictExpr>(next());
    while (!at_op("}")) {
      if (!d->items.empty()) expect_op(",");
      if (at_op("}")) break;
      ExprPtr key = parse_expression(true);
      expect_op(":");
      d->items.emplace_back(std::move(key), parse_expression(true));
    }
    next();
    return d;
  }

  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (at_op(".") || at_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (at_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (at_op("|")) {
        n = parse_filters(std::move(n));
      } else if (at_name("is")) {
        n = parse_test(std::move(n));
      } else if (at_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const Token& at = next();
    if (at.text == ".") {
      const Token& attr = cur();
      if (attr.type == Tok::Name) {
        next();
        auto g = node<GetAttr>(at);
        g->obj = std::move(obj);
        g->name = attr.text;
        return g;
      }
      if (attr.type == Tok::Int) {
        next();
        auto g = node<GetItem>(at);
        g->obj = std::move(obj);
        auto c = node<Const>(attr);
        c->value = Value::integer(attr.int_value);
        g->key = std::move(c);
        return g;
      }
      error(attr, "expected name or number, got " + describe(attr));
    }
    // '[' subscript ']': an index, a slice, or a tuple of indexes
    std::vector<ExprPtr> args;
    ExprPtr slice;
    while (!at_op("]")) {
      if (!args.empty() || slice) expect_op(",");
      ExprPtr start;
      if (!at_op(":")) {
        start = parse_expression(true);
        if (!at_op(":")) {
          args.push_back(std::move(start));
          continue;
        }
      }
      // a slice
      if (slice || !args.empty()) error(cur(), "unsupported: a slice inside a tuple subscript");
      auto s = node<SliceExpr>(at);
      s->start = std::move(start);
      next();  // ':'
      if (!at_op("]") && !at_op(",") && !at_op(":")) s->stop = parse_expression(true);
      if (at_op(":")) {
        next();
        if (!at_op("]") && !at_op(",")) s->step = parse_expression(true);
      }
      slice = std::move(s);
    }
    next();
    if (slice) {
      if (!args.empty()) error(at, "unsupported: a slice inside a tuple subscript");
      auto* s = static_cast<SliceExpr*>(slice.get());
      s->obj = std::move(obj);
      return slice;
    }
    if (args.empty()) error(at, "expected an expression inside '[]'");
    auto g = node<GetItem>(at);
    g->obj = std::move(obj);
    if (args.size() == 1) {
      g->key = std::move(args[0]);
    } else {
      auto t = node<ListExpr>(at);
      t->tuple = true;
      t->items = std::move(args);
      g->key = std::move(t);
    }
    return g;
  }

  CallArgsExpr parse_call_args() {
    const Token& open = cur();
    expect_op("(");
    CallArgsExpr args;
    bool require_comma = false;
    while (!at_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (at_op(")")) break;
      }
      if (at_op("*") || at_op("**")) error(cur(), "unsupported: *args and **kwargs in calls");
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string key = next().text;
        next();
        args.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!args.keyword.empty()) error(cur(), "invalid syntax for function call expression: positional argument after keyword argument");
        args.positional.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    (void)open;
    next();
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = node<Call>(cur());
    c->callee = std::move(callee);
    c->args = parse_call_args();
    return c;
  }

  ExprPtr parse_filters(ExprPtr value) {
    while (at_op("|")) {
      next();
      const Token& name_tok = cur();
      std::string name = expect_name().text;
      while (at_op(".")) {
        next();
        name += "." + expect_name().text;
      }
      auto f = node<FilterExpr>(name_tok);
      f->value = std::move(value);
      f->name = std::move(name);
      if (at_op("(")) f->args = parse_call_args();
      value = std::move(f);
    }
    return value;
  }

  ExprPtr parse_test(ExprPtr value) {
    const Token& at = next();  // 'is'
    bool negated = false;
    if (at_name("not")) {
      next();
      negated = true;
    }
    const Token& name_tok = cur();
    std::string name = expect_name().text;
    while (at_op(".")) {
      next();
      name += "." + expect_name().text;
    }
    auto t = node<TestExpr>(name_tok);
    t->value = std::move(value);
    t->name = std::move(name);
    t->negated = negated;
    (void)at;
    if (at_op("(")) {
      t->args = parse_call_args();
    } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Int ||
                cur().type == Tok::Float || at_op("(") || at_op("[") || at_op("{")) &&
               !at_name("else") && !at_name("or") && !at_name("and")) {
      if (at_name("is")) error(cur(), "You cannot chain multiple tests with is");
      t->args.positional.push_back(parse_postfix(parse_primary()));
    }
    return t;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  const std::string& name_;
  int depth_ = 0;
  int loop_depth_ = 0;
  int macro_depth_ = 0;
  int block_depth_ = 0;  // inside for, macro, block set or generation bodies
};

}  // namespace

std::shared_ptr<Program> parse_program(std::string_view source, const std::string& name) {
  auto program = std::make_shared<Program>();
  program->name = name;
  Parser parser(lex(source, name), program->name);
  program->body = parser.parse_template();
  return program;
}

}  // namespace strata::text::jinja
