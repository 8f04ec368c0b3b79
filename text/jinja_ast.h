// The parsed form of a template: expression and statement nodes, each with the line/column it
// came from. jinja_parser.cpp builds them; jinja_eval.cpp evaluates them.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja_internal.h"

namespace strata::text::jinja {

struct Pos {
  int line = 1;
  int column = 1;
};

// --- expressions ---

struct Expr {
  Pos pos;
  virtual ~Expr() = default;
  // Evaluates; an EvalError from below becomes an Error at this node's position.
  Value eval(Context& ctx) const;

 protected:
  virtual Value do_eval(Context& ctx) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Const : Expr {
  Value value;
  Value do_eval(Context&) const override;
};
struct Name : Expr {
  std::string name;
  Value do_eval(Context& ctx) const override;
};
struct ListExpr : Expr {  // [a, b] or (a, b)
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value do_eval(Context& ctx) const override;
};
struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value do_eval(Context& ctx) const override;
};
struct GetAttr : Expr {  // obj.name
  ExprPtr obj;
  std::string name;
  Value do_eval(Context& ctx) const override;
};
struct GetItem : Expr {  // obj[key]
  ExprPtr obj, key;
  Value do_eval(Context& ctx) const override;
};
struct SliceExpr : Expr {  // obj[start:stop:step]; absent parts are null
  ExprPtr obj, start, stop, step;
  Value do_eval(Context& ctx) const override;
};
struct CallArgsExpr {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
  CallArgs eval(Context& ctx) const;
};
struct Call : Expr {
  ExprPtr callee;
  CallArgsExpr args;
  Value do_eval(Context& ctx) const override;
};
struct FilterExpr : Expr {  // value | name(args)
  ExprPtr value;
  std::string name;
  CallArgsExpr args;
  Value do_eval(Context& ctx) const override;
};
struct TestExpr : Expr {  // value is [not] name(args)
  ExprPtr value;
  std::string name;
  CallArgsExpr args;
  bool negated = false;
  Value do_eval(Context& ctx) const override;
};
struct Captured : Expr {  // the body of {% set x | filter %}...{% endset %}
  Value do_eval(Context& ctx) const override;
};
struct Unary : Expr {  // not / - / +
  char op;             // '!', '-', '+'
  ExprPtr operand;
  Value do_eval(Context& ctx) const override;
};
struct Binary : Expr {
  BinOp op;
  ExprPtr left, right;
  Value do_eval(Context& ctx) const override;
};
struct Logic : Expr {  // and / or, returning an operand as Python does
  bool is_and;
  ExprPtr left, right;
  Value do_eval(Context& ctx) const override;
};
struct Concat : Expr {  // a ~ b ~ c
  std::vector<ExprPtr> parts;
  Value do_eval(Context& ctx) const override;
};
struct Compare : Expr {  // a < b <= c, chained as in Python; ops: == != < <= > >= in notin
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;
  Value do_eval(Context& ctx) const override;
};
struct CondExpr : Expr {  // a if test else b
  ExprPtr test, then, otherwise;  // otherwise may be null
  Value do_eval(Context& ctx) const override;
};

// --- statements ---

enum class Flow { Normal, Break, Continue };

struct Stmt {
  Pos pos;
  virtual ~Stmt() = default;
  virtual Flow exec(Context& ctx) const = 0;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// An assignment target: a name, ns.attr (set only), or a tuple of targets.
struct Target {
  enum class Kind { Name, Attr, Tuple } kind = Kind::Name;
  Pos pos;
  std::string name;  // Name, or the namespace variable of Attr
  std::string attr;
  std::vector<Target> items;
};

struct Text : Stmt {
  std::string text;
  Flow exec(Context& ctx) const override;
};
struct Print : Stmt {
  ExprPtr expr;
  Flow exec(Context& ctx) const override;
};
struct If : Stmt {
  std::vector<std::pair<ExprPtr, Body>> branches;  // if, elif...
  Body otherwise;
  Flow exec(Context& ctx) const override;
};
struct For : Stmt {
  Target target;
  ExprPtr iter;
  ExprPtr filter;  // for x in y if filter; may be null
  Body body, otherwise;
  Flow exec(Context& ctx) const override;
};
struct Assign : Stmt {
  Target target;
  ExprPtr value;
  Flow exec(Context& ctx) const override;
};
struct AssignBlock : Stmt {
  Target target;
  Body body;
  ExprPtr filter;  // built on Captured; may be null
  Flow exec(Context& ctx) const override;
};
struct MacroDef : Stmt {
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param, null when required
  Body body;
  Flow exec(Context& ctx) const override;
};
struct LoopControl : Stmt {
  bool is_break;
  Flow exec(Context& ctx) const override;
};
struct ScopedBlock : Stmt {  // {% generation %}: the body in a scope of its own (a CallBlock in Python)
  Body body;
  Flow exec(Context& ctx) const override;
};

struct Program {
  std::string name;
  Body body;
};

// Parses the token stream of `source`; throws Error on a syntax error or unsupported tag.
std::shared_ptr<Program> parse_program(std::string_view source, const std::string& name);

}  // namespace strata::text::jinja
