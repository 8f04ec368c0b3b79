// The Jinja interpreter against Python Jinja2: every case of fixtures/chat/jinja_cases.json
// (rendered by make_fixtures.py) must give Python's output, fail where Python fails (on the same
// line), or fail saying "unsupported" where Python renders something this does not do. Then the
// error format, the parse/runtime positions and the bounds against runaway templates.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "text/gzip_file.h"
#include "text/jinja.h"

namespace strata::text::jinja {
namespace {

nlohmann::ordered_json load_cases() {
  return nlohmann::ordered_json::parse(
      read_text_file(std::string(STRATA_SOURCE_DIR) + "/tests/text/fixtures/chat/jinja_cases.json"));
}

std::string render(std::string_view source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object(),
                   const Limits& limits = {}) {
  return Template::parse(source, "t").render(from_json(context), limits);
}

// The Error a template raises, parsing or rendering.
Error error_of(std::string_view source, const nlohmann::ordered_json& context = nlohmann::ordered_json::object(),
               const Limits& limits = {}) {
  try {
    render(source, context, limits);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error from: " << source;
  return Error("t", 0, 0, "no error");
}

TEST(JinjaCases, MatchPythonJinja2) {
  const auto fixture = load_cases();
  int outputs = 0, errors = 0, unsupported = 0;
  for (const auto& c : fixture["cases"]) {
    const std::string name = c["name"];
    const std::string source = c["template"];
    SCOPED_TRACE("case " + name + ": " + source);
    std::string out;
    std::optional<Error> err;
    try {
      out = render(source, c["context"]);
    } catch (const Error& e) {
      err = e;
    }
    if (c.value("unsupported", false)) {
      ++unsupported;
      ASSERT_TRUE(err) << "rendered " << out << " instead of refusing";
      EXPECT_NE(err->message().find("unsupported"), std::string::npos) << err->what();
    } else if (c.contains("error")) {
      ++errors;
      ASSERT_TRUE(err) << "Python fails (" << c["error"].get<std::string>() << ") but this rendered: " << out;
      if (c.contains("error_line")) {
        EXPECT_EQ(err->line(), c["error_line"].get<int>()) << err->what();
      }
      if (c["error_type"] == "TemplateError") {
        EXPECT_EQ(err->message(), c["error"].get<std::string>());
      }
    } else {
      ++outputs;
      ASSERT_FALSE(err) << err->what();
      EXPECT_EQ(out, c["output"].get<std::string>());
    }
  }
  EXPECT_GT(outputs, 80);
  EXPECT_GT(errors, 25);
  EXPECT_GT(unsupported, 10);
}

TEST(JinjaErrors, NameLineAndColumn) {
  const Error e = error_of("line one\n  {{ 'x' | wordwrap }}");
  EXPECT_STREQ(e.what(), "t line 2, column 12: unsupported filter 'wordwrap'");
  EXPECT_EQ(e.template_name(), "t");
  EXPECT_EQ(e.line(), 2);
  EXPECT_EQ(e.column(), 12);
  EXPECT_EQ(e.message(), "unsupported filter 'wordwrap'");
}

TEST(JinjaErrors, ColumnsCountCharactersNotBytes) {
  const Error e = error_of("é€🙂{{ x.y }}");  // 3 characters, 9 bytes before the tag
  EXPECT_EQ(e.line(), 1);
  EXPECT_EQ(e.column(), 8);  // the '.' of x.y
  EXPECT_EQ(e.message(), "'x' is undefined");
}

TEST(JinjaErrors, UnsupportedConstructsAreNamed) {
  EXPECT_EQ(error_of("{% include 'x' %}").message(), "unsupported tag 'include'");
  EXPECT_EQ(error_of("{% frobnicate %}").message(), "unknown tag 'frobnicate'");
  EXPECT_EQ(error_of("{{ 1 is prime }}").message(), "unsupported test 'prime'");
  EXPECT_EQ(error_of("{{ 'a'.expandtabs() }}").message(), "unsupported string method 'expandtabs'");
  EXPECT_EQ(error_of("{{ 'a b'|wordcount }}").message(), "unsupported filter 'wordcount'");
  EXPECT_EQ(error_of("{% for x in y recursive %}{% endfor %}").message(), "unsupported: recursive for loops");
}

TEST(JinjaErrors, SyntaxErrorsPointAtTheToken) {
  const Error unclosed = error_of("{% if x %}\nbody");
  EXPECT_EQ(unclosed.line(), 2);
  EXPECT_NE(unclosed.message().find("'endif'"), std::string::npos) << unclosed.what();
  const Error expr = error_of("{{ 1 +  }}");
  EXPECT_EQ(expr.column(), 9);
  EXPECT_EQ(error_of("\n{% endfor %}").line(), 2);
  EXPECT_EQ(error_of("{{ 'abc }}").column(), 4);
}

TEST(JinjaErrors, UnknownFilterOnlyFailsWhenEvaluated) {
  // As Jinja2 does inside an if block: the branch not taken never resolves the filter.
  EXPECT_EQ(render("{% if false %}{{ x|wordwrap }}{% endif %}ok"), "ok");
}

TEST(JinjaErrors, RaiseExceptionKeepsTheTemplatesMessage) {
  const Error e = error_of("{% for m in messages %}\n{% if m.role == 'bot' %}{{ raise_exception('no bots: ' ~ m.role) }}{% endif %}{% endfor %}",
                           {{"messages", {{{"role", "bot"}}}}});
  EXPECT_EQ(e.message(), "no bots: bot");
  EXPECT_EQ(e.line(), 2);
}

TEST(JinjaLimits, OutputSize) {
  Limits small;
  small.max_output_bytes = 1000;
  EXPECT_EQ(render("{% for i in range(10) %}0123456789{% endfor %}", nlohmann::ordered_json::object(), small).size(), 100u);
  const Error e = error_of("{% for i in range(1000) %}0123456789{% endfor %}", nlohmann::ordered_json::object(), small);
  EXPECT_NE(e.message().find("rendered output exceeds the limit of 1000 bytes"), std::string::npos) << e.what();
}

TEST(JinjaLimits, Steps) {
  Limits small;
  small.max_steps = 10000;
  const Error e = error_of("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", nlohmann::ordered_json::object(), small);
  EXPECT_NE(e.message().find("exceeded 10000 steps"), std::string::npos) << e.what();
}

TEST(JinjaLimits, MacroRecursion) {
  const Error e = error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  EXPECT_NE(e.message().find("macro calls nested deeper than 200"), std::string::npos) << e.what();
}

TEST(JinjaLimits, ValueSize) {
  const Error e = error_of("{{ 'x' * 1000000000000 }}");
  EXPECT_NE(e.message().find("exceeds the size limit"), std::string::npos) << e.what();
}

TEST(JinjaLimits, ParseNesting) {
  const std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  const Error e = error_of(deep);
  EXPECT_NE(e.message().find("nested too deeply"), std::string::npos) << e.what();
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  EXPECT_NE(error_of(blocks).message().find("nested too deeply"), std::string::npos);
}

TEST(JinjaValues, FromJsonKeepsOrderedKeysAndTypes) {
  const auto j = nlohmann::ordered_json::parse(R"({"b": 1, "a": [1.5, true, null, "s", 9223372036854775807]})");
  EXPECT_EQ(Template::parse("{{ x|tojson }}", "t").render(Value::dict({{"x", from_json(j)}})),
            R"({"b": 1, "a": [1.5, true, null, "s", 9223372036854775807]})");
  EXPECT_THROW(from_json(nlohmann::json::parse("18446744073709551615")), std::invalid_argument);
  EXPECT_THROW(Template::parse("x", "t").render(Value::list({})), std::invalid_argument);
}

TEST(JinjaValues, TemplateIsReusableAndThreadFree) {
  const Template t = Template::parse("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", "t");
  EXPECT_EQ(t.render(from_json(nlohmann::json{{"xs", {1, 2, 3}}})), "6");
  EXPECT_EQ(t.render(from_json(nlohmann::json{{"xs", {4}}})), "4");  // no state kept between renders
}

TEST(JinjaValues, InvalidUtf8TemplateIsRefused) {
  EXPECT_THROW(Template::parse("a\xff", "t"), Error);
}

}  // namespace
}  // namespace strata::text::jinja
