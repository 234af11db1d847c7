"""Does nvImageCodec still print its nvTIFF/nvJPEG2000 load errors under DALI_NVIMGCODEC_LOG_LEVEL? One decode each."""

import os
import subprocess
import sys
from pathlib import Path

PHOTO = Path(__file__).resolve().parents[2] / "data" / "photos" / "astronaut.jpg"
CODE = f"""
import numpy as np
from nvidia.dali import fn, pipeline_def
data = np.frombuffer(open({str(PHOTO)!r}, 'rb').read(), dtype=np.uint8)
@pipeline_def(batch_size=1, num_threads=1, device_id=0)
def pipe():
    return fn.decoders.image(fn.external_source(source=lambda: [data], batch=True), device='mixed')
p = pipe(); p.build(); out, = p.run(); print('decoded', out.as_cpu().as_array().shape)
"""
for level in (None, "1", "0"):
    env = dict(os.environ)
    if level is not None:
        env["DALI_NVIMGCODEC_LOG_LEVEL"] = level
    r = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    text = r.stdout + r.stderr
    print(f"level={level} rc={r.returncode} nvtiff_lines={text.lower().count('nvtiff')} "
          f"nvjpeg2k_lines={text.lower().count('nvjpeg2')} decoded={'decoded' in text}")
    print("   ", " | ".join(text.strip().splitlines()[-4:])[:400])
