"""Which graphs does parallelize_model + forward + generate compile? (trace dir per rank)"""
import sys, time
from pathlib import Path
import torch
from tests._dist import run_ranks
from tests._tiny import save_tiny

def _rank(rank, world, folder, trace, n):
    from autotp import parallelize_model
    model = parallelize_model(folder, tp_size=world, progress=False, trace_dir=trace)
    marks = [model.autotp.context.graphs_compiled]
    ids = torch.tensor([[5, 17, 99, 3, 64, 12, 7]])
    with torch.no_grad():
        model(input_ids=ids); marks.append(model.autotp.context.graphs_compiled)
        model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=120); marks.append(model.autotp.context.graphs_compiled)
    return marks

if __name__ == "__main__":
    arch = sys.argv[1]
    folder = save_tiny(arch, Path("/tmp/suite") / arch, pad_token_id=120)
    t = time.perf_counter()
    print(run_ranks(_rank, 2, str(folder), sys.argv[2], 16), time.perf_counter() - t)
