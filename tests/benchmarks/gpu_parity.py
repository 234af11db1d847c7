"""The gpu classifier against the onnx engine on the device: top-1 agreement on the 520-image parity set (FP16 and
FP32 networks), and tests/support/oddities.py's statuses and error kinds."""

from __future__ import annotations

import numpy as np

from image_sets import make_set


def oddities_part(results: dict, net, spec) -> None:
    """tests/support/oddities.py through the gpu engine (DALI) on the device vs the onnx engine: statuses and error
    kinds."""
    from support.oddities import oddities

    from pipeline.engines.onnx import OnnxEngine
    from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier
    from pipeline.model.folder import load_model

    odd = oddities()
    names = list(odd)
    datas = [odd[n][0] for n in names]
    ref = OnnxEngine(load_model(None), top_k=5).classify(datas)
    clf = GpuClassifier(net, spec, ClassifierOptions(top_k=5, batch_size=8))
    raw = clf.classify(datas)
    clf.close()
    rows, same = {}, 0
    for i, name in enumerate(names):
        gpu = ("error", raw.errors[i].split(":", 1)[0]) if raw.errors[i] else ("ok", None)
        onnx = (ref[i].status, ref[i].error.split(":", 1)[0] if ref[i].error else None)
        rows[name] = {"gpu": gpu, "onnx": onnx, "top1": [int(raw.class_ids[i, 0]), (ref[i].class_ids or [None])[0]]}
        same += gpu == onnx
    results["oddities"] = {"same_status_and_kind": f"{same}/{len(names)}", "rows": rows}


def parity(results: dict, clf_default, clf_fp32=None) -> None:
    """Top-1 agreement of the gpu engine (FP16, GPU decode and resize) with the ONNX Runtime CPU reference."""
    from pipeline.model.folder import load_model

    parity_set = make_set(520, "varied", 10_000)
    bundle = load_model(None)
    try:
        from pipeline.engines.onnx import OnnxEngine

        ref_engine = OnnxEngine(bundle, top_k=5)
        ref = ref_engine.classify(parity_set)
        ref_engine.close()
    except ImportError:
        raise SystemExit("pipeline.engines.onnx.OnnxEngine is needed for the parity check")
    for label, clf in (("parity", clf_default), ("parity_fp32_network", clf_fp32)):
        if clf is not None:
            _compare(results, label, parity_set, ref, clf.classify(parity_set))


def _compare(results: dict, label: str, parity_set: list[bytes], ref, raw) -> None:
    agree, n, dprob, disagreements = 0, 0, [], []
    decisive, decisive_agree = 0, 0
    for i, r in enumerate(ref):
        if r.status != "ok" or raw.errors[i]:
            disagreements.append({"i": i, "ref": r.error, "gpu": raw.errors[i]})
            continue
        n += 1
        g1 = int(raw.class_ids[i, 0])
        margin = r.scores[0] - (r.scores[1] if len(r.scores) > 1 else 0.0)
        if margin > 0.01:  # the reference's top-1 leads its top-2 by more than 1 point
            decisive += 1
            decisive_agree += int(g1 == r.class_ids[0])
        if g1 == r.class_ids[0]:
            agree += 1
            dprob.append(abs(float(raw.scores[i, 0]) - r.scores[0]))
        else:
            disagreements.append({
                "i": i, "ref_top2": r.class_ids[:2], "ref_p": [round(p, 4) for p in r.scores[:2]],
                "gpu_top2": raw.class_ids[i, :2].tolist(), "gpu_p": [round(float(p), 4) for p in raw.scores[i, :2]],
            })
    results[label] = {
        "images": len(parity_set),
        "decisive_images": decisive,
        "decisive_top1_agreement": round(decisive_agree / max(decisive, 1), 4),
        "mean_kb": round(sum(map(len, parity_set)) / len(parity_set) / 1024, 1),
        "compared": n,
        "top1_agreement": round(agree / max(n, 1), 4),
        "mean_abs_top1_prob_diff": round(float(np.mean(dprob)) if dprob else 0.0, 5),
        "max_abs_top1_prob_diff": round(float(np.max(dprob)) if dprob else 0.0, 5),
        "disagreements": disagreements[:20],
    }
