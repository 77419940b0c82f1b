"""Evaluation harness: RULER-style tasks on a real model, every method at matched bytes.

``tasks/`` generates samples, ``prefill.py`` builds every method from one exact prefill,
``runner.py`` runs and resumes, ``scoring.py`` scores, ``report.py`` summarises and plots.
"""
