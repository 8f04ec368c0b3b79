// Size flags: "24G", "512M", bad forms rejected with the text in the message.
#include <gtest/gtest.h>

#include "offload/size.h"

using strata::offload::format_size;
using strata::offload::parse_size;

TEST(Size, ParsesBinaryUnits) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("512M"), 512ull << 20);
  EXPECT_EQ(parse_size("24G"), 24ull << 30);
  EXPECT_EQ(parse_size("24GiB"), 24ull << 30);
  EXPECT_EQ(parse_size("1.5G"), 3ull << 29);
  EXPECT_EQ(parse_size("2t"), 2ull << 40);
  EXPECT_EQ(parse_size("8k"), 8192u);
}

TEST(Size, RejectsMalformedText) {
  for (const char* bad : {"", "G", "12X", "1.2.3G", "-1G", "12GG", "1e5"}) {
    EXPECT_THROW(parse_size(bad), std::invalid_argument) << bad;
  }
  try {
    parse_size("12X");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'12X'"), std::string::npos);
  }
}

TEST(Size, Formats) {
  EXPECT_EQ(format_size(100), "100 B");
  EXPECT_EQ(format_size(3ull << 29), "1.50 GiB");
}
