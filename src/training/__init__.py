"""Training runs.

The Loop around Trax, fine-tuning, sample replies and multi-process
training.
"""
