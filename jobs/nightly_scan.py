"""`ray job submit` entrypoint of the nightly scan: `bulk-classify nightly` with the same options.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/nightly_scan.py --source s3://photos/incoming --output-root s3://photos-labels/nightly

What it does, its options and exit status: `bulk-classify nightly --help` (pipeline/nightly.py).
"""

import sys
from pathlib import Path

try:
    import pipeline  # noqa: F401
except ImportError:  # uploaded as a working dir without the package installed: it is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.cli import main  # noqa: E402

if __name__ == "__main__":
    main(["nightly", *sys.argv[1:]], prog_name="nightly_scan.py")
