"""Looking inside: sanity checks against PyTorch (`qkv check`)."""

from qkv.analysis.sanity import CheckResult, run_checks

__all__ = ["CheckResult", "run_checks"]
