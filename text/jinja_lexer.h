// The Jinja2 lexer as transformers configures it: {{ }}, {% %}, {# #}, whitespace control with
// - and +, trim_blocks and lstrip_blocks, newlines normalized and one trailing newline dropped.
// Output: data and tag tokens with 1-based line/column for error messages.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::text::jinja {

enum class Tok {
  Data,        // template text, already whitespace-controlled
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,
  String,      // text holds the decoded value
  Int,
  Float,
  Op,          // text holds the operator: + - * / // % ** ~ == != < <= > >= = . : | , ( ) [ ] { } ;
  Eof,
};

struct Token {
  Tok type;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;
};

// Throws Error naming `name` and the position on a lexical error (unterminated tag, string or
// comment; unexpected character; unbalanced brackets; {% raw %}).
std::vector<Token> lex(std::string_view source, const std::string& name);

}  // namespace strata::text::jinja
