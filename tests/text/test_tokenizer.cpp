// placeholder
#include <gtest/gtest.h>
#include "text/tokenizer.h"
TEST(Tokenizer, Builds) { SUCCEED(); }
