"""Using a trained model: `fastpipe predict` (run.py), `fastpipe export` (export.py) and `fastpipe.Predictor`
(predictor.py), each preparing photos exactly as the model's training photos were prepared (photos.py, the model
card of train/modelcard.py)."""
