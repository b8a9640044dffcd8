"""Any diffusers text-to-image pipeline as a model family: a checkpoint whose model_index.json
`_class_name` has no native family runs through diffusers' own pipeline class.

index.py (standard library only: the driver refuses what cannot run before any work),
family.py (the family: buckets, compile regions, memory from the safetensors headers) and
loader.py (torch and diffusers: the loaded pipeline behind the interface the actor drives).
"""
