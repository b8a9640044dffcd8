"""The tiny model's recipe: training (train.py: VAE, DiT and text encoder, decoder adaptation),
data-parallel CPU processes, and the adherence report (evaluate.py). What inference needs, the
weights, the text encoder, the scene captions and the adherence check, stays in ditfleet.model.tiny."""
