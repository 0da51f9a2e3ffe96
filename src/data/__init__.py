"""Chat data.

The line format, importers, the tokenizer, the token cache and the training
windows.
"""
