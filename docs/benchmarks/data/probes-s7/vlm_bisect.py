"""Which part of a synthetic Qwen2.5-VL crashes MLX's CUDA build: each step in a process of its own."""
import subprocess, sys
STEP = r'''
import sys, io
import mlx.core as mx
from mlxrt.synthetic.build import ensure_model
from mlx_vlm import load, stream_generate
path = str(ensure_model(sys.argv[1])); what = sys.argv[2]
model, processor = load(path)
if what == "lm":
    out = model.language_model(mx.array([[11] * 256]))
    mx.eval(out.logits if hasattr(out, "logits") else out); print("lm ok")
elif what == "vision-f32":
    model.vision_tower.set_dtype(mx.float32)
if what in ("text", "image", "vision-f32"):
    import numpy as np
    from PIL import Image
    msgs = [{"role": "user", "content": "Describe the weather."}]
    imgs = []
    if what != "text":
        imgs = [Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8))]
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    n = 0
    for r in stream_generate(model, processor, prompt, image=imgs or None, max_tokens=4):
        n += 1
    print(what, "ok", n)
'''
name = sys.argv[1]
for what in sys.argv[2:]:
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", STEP, name, what], capture_output=True,
                       text=True, timeout=120)
    tail = [l for l in (p.stdout + p.stderr).splitlines() if "level" not in l and "[transformers]" not in l]
    print(f"--- {what}: rc {p.returncode}"); print("\n".join(tail[-8:]), flush=True)
