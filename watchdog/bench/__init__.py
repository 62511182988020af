"""Labelled trace corpus, baseline detectors and scoring."""
