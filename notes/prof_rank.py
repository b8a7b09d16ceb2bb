"""Profile one 2-rank parallelize_model + forward + generate(16) on tiny llama; rank 0 cProfile."""
import cProfile, io, pstats, sys, time
from pathlib import Path
import torch
from tests._dist import run_ranks
from tests._tiny import save_tiny

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]

def _rank(rank, world, folder, arch):
    t0 = time.perf_counter()
    import transformers  # noqa
    from autotp import parallelize_model
    t_imp = time.perf_counter() - t0
    pr = cProfile.Profile()
    pr.enable()
    t1 = time.perf_counter()
    model = parallelize_model(folder, tp_size=world, progress=False)
    t_par = time.perf_counter() - t1
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        t2 = time.perf_counter(); model(input_ids=ids); t_fwd = time.perf_counter() - t2
        t3 = time.perf_counter(); model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=120); t_gen = time.perf_counter() - t3
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(70)
    outcomes = None
    try:
        outcomes = [o.as_dict() for o in model.autotp.context.plan_cache.outcomes]
    except Exception as e:
        outcomes = repr(e)
    return dict(imp=t_imp, par=t_par, fwd=t_fwd, gen=t_gen, prof=s.getvalue(), graphs=model.autotp.context.graphs_compiled, outcomes=outcomes)

if __name__ == "__main__":
    arch = sys.argv[1] if len(sys.argv) > 1 else "llama"
    folder = save_tiny(arch, Path("/tmp/suite") / arch, pad_token_id=120)
    t = time.perf_counter()
    res = run_ranks(_rank, 2, str(folder), arch)
    print("total", time.perf_counter() - t)
    for r in res:
        print({k: v for k, v in r.items() if k != "prof"})
    print(res[0]["prof"])
