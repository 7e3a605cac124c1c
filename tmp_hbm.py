import sys, re
from glm5_jax.parallel import hlo_stats as H
orig = H._source
def fine(inst):
    m = H._OP_NAME.search(inst.rest)
    name = m.group(1) if m else "-"
    name = re.sub(r"jit\(step\)/while/body/closed_call/", "", name)
    return f"{inst.op:22s} {inst.type_text[:70]:70s} {name[-110:]}"
H._source = fine
st = H.hlo_stats(open(sys.argv[1]).read(), 256)
tot = st.hbm_bytes
print(f"total {tot/1e12:.3f} TB")
for k, v in list(st.hbm_bytes_by_source.items())[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
    print(f"{v/1e9:8.1f} GB {100*v/tot:5.1f}%  {k}")
