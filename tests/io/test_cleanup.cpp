// io/cleanup: what a second Ctrl-C removes without the normal path (async-signal-safe calls
// only): registered files, empty directories, and the flat trees of a checkpoint or save being
// written; unregistered paths stay.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "io/cleanup.h"

namespace fs = std::filesystem;

namespace {

TEST(Cleanup, EmergencyRemovesRegisteredFilesDirectoriesAndTrees) {
  std::string t = (fs::path(::testing::TempDir()) / "strata_cleanup_XXXXXX").string();
  ASSERT_NE(::mkdtemp(t.data()), nullptr);
  const fs::path dir = t;
  fs::create_directories(dir / "tree");
  // More entries than one getdents64 buffer holds.
  for (int i = 0; i < 400; ++i) std::ofstream(dir / "tree" / ("file-with-a-longish-name-" + std::to_string(i))) << i;
  fs::create_directories(dir / "empty");
  std::ofstream(dir / "file") << "x";
  std::ofstream(dir / "kept") << "x";
  fs::create_directories(dir / "kept-tree");
  std::ofstream(dir / "kept-tree" / "a") << "x";
  const int a = strata::io::register_cleanup_tree((dir / "tree").string());
  const int b = strata::io::register_cleanup((dir / "empty").string(), true);
  const int c = strata::io::register_cleanup((dir / "file").string(), false);
  const int d = strata::io::register_cleanup_tree((dir / "kept-tree").string());
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  ASSERT_GE(c, 0);
  ASSERT_GE(d, 0);
  strata::io::unregister_cleanup(d);
  strata::io::emergency_cleanup();
  EXPECT_FALSE(fs::exists(dir / "tree"));
  EXPECT_FALSE(fs::exists(dir / "empty"));
  EXPECT_FALSE(fs::exists(dir / "file"));
  EXPECT_TRUE(fs::exists(dir / "kept"));
  EXPECT_TRUE(fs::exists(dir / "kept-tree" / "a"));
  for (int s : {a, b, c}) strata::io::unregister_cleanup(s);
  fs::remove_all(dir);
}

}  // namespace
