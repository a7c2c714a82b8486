"""Offline artifacts: the store (files keyed by model identity), the kinds table and the per-kind loaders.

Below everything that reads them (scorers, budgets, methods); the calibrations that write them live above, in
:mod:`kvtrim.calibration`.
"""
