// The heavy LibTorch headers, precompiled once and reused by every target.
#pragma once
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
