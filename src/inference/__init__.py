"""Using a trained model.

Loading it, the incremental decoder, sampling, chat sessions and scoring.
"""
