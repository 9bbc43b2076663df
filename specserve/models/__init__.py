"""The model library both services build on: configs, layers, attention, MoE, the shared CausalLM, the paged KV
cache and its metadata, the block manager, and the checkpoint loader. Import from the submodules."""
