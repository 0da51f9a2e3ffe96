"""Every file name in a run folder (out-dir) or an export, spelled once.

Names only: each is read and written by the module named beside it.
"""

# The run's resolved `train` settings (`src.training.trainer`); `python
# train.py --config OUT_DIR/settings.json` repeats the run.
SETTINGS = 'settings.json'
MODEL_GIN = 'model.gin'  # The model's bindings (`src.model.ginconf`).
OPERATIVE_GIN = 'config.gin'  # What the run actually used (gin's view).
TOKENIZER_MODEL = 'tokenizer.model'  # sentencepiece (`src.data.tokenizer`).
TOKENIZER_INFO = 'tokenizer.json'  # Its markers and settings.
CACHE = 'cache'  # Token caches, one folder per data set (`src.data.corpus`).
LOCK = 'train.lock'  # Held while a run trains (`src.core.runlock`).
# Trax's checkpoint (`src.storage.checkpoints`): metadata pickle, weights,
# optimizer slots; the manifest seals them; snapshots keep older ones.
CHECKPOINT = 'model.pkl.gz'
WEIGHTS = 'model.weights.npy.gz'
MANIFEST = 'model.manifest.json'
SNAPSHOTS = 'checkpoints'
INIT = 'init.json'  # A fine-tune's source (`src.training.finetune`).
TRAIN_EVENTS = 'train'  # TensorBoard event folders.
EVAL_EVENTS = 'eval'
# An export (`src.storage.export`).
EXPORT_META = 'export.json'
EXPORT_WEIGHTS = 'model.safetensors'
MODEL_CARD = 'README.md'
# An export's curves (src/storage/curves.py): scalars and their picture.
CURVES = 'curves.json'
CURVES_PICTURE = 'loss.png'
# A fine-tune run's copy of its pretrained model's curves: PREFIX + name.
PRETRAINED_CURVES = 'pretrained-'
