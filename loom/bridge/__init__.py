"""Moving modality embeddings from each encoder's layout to the LLM's, forward and backward."""
