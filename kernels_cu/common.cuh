// cuflash: device helpers shared by every kernel family.
//
// NVRTC does not define INFINITY (no <math.h>), so the constants are spelled out here.
// Loads and stores of the 16-bit types go through to_float/from_float so that a kernel body is
// written once for every dtype; the dtype is chosen by the variant's #define prelude.
#pragma once

#define CUFLASH_NEG_INF (-__int_as_float(0x7f800000))
#define CUFLASH_LOG2E 1.4426950408889634f
