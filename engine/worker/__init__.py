"""What touches the device: the model runner, its batch layout, the sampler, the host swap copies, CUDA graphs,
memory profiling and bandwidth."""
