"""Host-side machinery shared by the engine and the speculator: building a step's flat batch
tensors, replaying CUDA graphs, and the per-batch sampling tensors. It sits below spec_decode
and above the models in the import graph, so that both the model runner and the drafter use it
without either reaching up into the other."""
