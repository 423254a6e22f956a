// keel/version.h: keel's version. The one place it is written: CMakeLists.txt's project()
// reads it from here.
#pragma once

#define KEEL_VERSION_MAJOR 0
#define KEEL_VERSION_MINOR 1
#define KEEL_VERSION_PATCH 0
#define KEEL_VERSION "0.1.0"
