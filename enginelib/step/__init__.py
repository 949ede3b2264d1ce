"""One step of compute, below both the engine core and the speed code, which both build on it: the step's Batch,
attention through the block tables, and the speed parts a model runner may be handed (the core imports no speed
code: one factory hands it them)."""
