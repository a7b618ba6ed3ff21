"""Thin entry point: the server-level logprob report lives in ``oscar_sglang.calibration.server_report``.

    .venv/bin/python scripts/report_server_logprobs.py --out docs        # writes docs/SERVER_ACCURACY.md, .json
"""

import sys

from oscar_sglang.calibration.server_report import main

if __name__ == "__main__":
    sys.exit(main())
