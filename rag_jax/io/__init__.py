"""A trained model in and out: Hugging Face checkpoints (BERT, DPR, BART, RAG, Llama folders
and GGUF files) imported and exported (`hf`), and the bundle, a trained model as one folder
(`bundle`, its layout in `bundle_format`)."""
