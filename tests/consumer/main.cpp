// Built against the installed package by tests/install_consumer.sh: one sharded training step.
#include <fsdp/fsdp.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", fsdp::Sharded<torch::nn::LinearImpl>(4, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x).sum(); }
  fsdp::Sharded<torch::nn::LinearImpl> fc;
};

int main() {
  auto pg = fsdp::init_process_group();
  auto model = fsdp::fully_shard(std::make_shared<NetImpl>(), pg);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));  // this rank's shards
  auto before = model->named_parameters()["fc.bias"].clone();
  model(torch::ones({2, 4})).backward();
  opt.step();
  // d(sum)/d(bias) = 2 per element: the bias moves by -0.2.
  auto moved = (before - model->named_parameters()["fc.bias"]).detach();
  if (!torch::allclose(moved, torch::full({3}, 0.2f))) {
    std::cerr << "consumer: unexpected update " << moved << "\n";
    return 1;
  }
  // fsdp::data links from the installed package: the order of 10 samples, seed 0, epoch 0
  // (docs/data.md's reference values), taken as one global batch of 10.
  fsdp::data::DistributedSampler sampler(10, pg, fsdp::data::SamplerOptions(10));
  const auto share = sampler.next_share();
  if (!share || share->indices.front() != 7 || fsdp::data::plan_batch(10, 1, 5).accumulation != 2) {
    std::cerr << "consumer: fsdp::data gave another order or plan\n";
    return 1;
  }
  std::cout << "consumer: ok\n";
  return 0;
}
