"""engine-sim: replay a trace through the real scheduler, policies and KV block manager on a
virtual clock, with the executor replaced by a calibrated step-cost model. No torch, no model,
no tokenizer: traces carry token counts."""
