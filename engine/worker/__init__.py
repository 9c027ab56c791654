"""What touches the device: the model runner, the sampler, CUDA graphs, memory profiling and bandwidth."""
