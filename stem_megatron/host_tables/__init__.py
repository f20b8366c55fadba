"""Host-resident STEM tables: node-shared storage, prefetch, touched-row gradients, CPU Adam."""
