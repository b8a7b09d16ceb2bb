import sys, torch
from pathlib import Path
from tests._tiny import save_tiny
from autotp import parallelize_model
folder = save_tiny(sys.argv[1], Path("/tmp/suite") / sys.argv[1], pad_token_id=120)
model = parallelize_model(str(folder), tp_size=1, progress=False)
ids = torch.tensor([[5, 17, 99, 3, 64, 12, 7]])
print("after warmup", model.autotp.context.graphs_compiled, flush=True)
with torch.no_grad():
    model(input_ids=ids); print("after fwd", model.autotp.context.graphs_compiled, flush=True)
    model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=120); print("after gen", model.autotp.context.graphs_compiled, flush=True)
    model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=120); print("after gen2", model.autotp.context.graphs_compiled, flush=True)
