"""Experiments built on the library: reproduce.py (the CPU-scale SAGE comparison), measure.py, report.py."""
