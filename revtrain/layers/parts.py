"""revtrain's own layers as gin-configurable parts of composed models (`revtrain.models.compose`).

Each name below is the layer class registered with gin (``@ByteEmbedding`` in a config), so a composed
model can use it as a standard layer, as F or G of a coupling, or as the head, with its other constructor
arguments bound in gin (``CausalSelfAttention.num_heads = 4``). The classes themselves are unchanged (gin
registers a configurable subclass), so Python code that constructs them directly is not affected by gin
bindings.

Language model (`revtrain.layers.transformer`): ``ByteEmbedding`` (standard), ``CausalSelfAttention`` (F),
``FeedForward`` (G), ``LanguageModelHead`` (head). RevNet (`revtrain.layers.revnet`): ``Stem`` and
``Downsample`` (standard), ``ResidualFn`` (F or G), ``ClassifierHead`` (head).
"""

import gin

from revtrain.layers import revnet, transformer

MODULE = "revtrain.layers"

ByteEmbedding = gin.external_configurable(transformer.ByteEmbedding, module=MODULE)
CausalSelfAttention = gin.external_configurable(transformer.CausalSelfAttention, module=MODULE)
FeedForward = gin.external_configurable(transformer.FeedForward, module=MODULE)
LanguageModelHead = gin.external_configurable(transformer.LanguageModelHead, module=MODULE)
Stem = gin.external_configurable(revnet.Stem, module=MODULE)
ResidualFn = gin.external_configurable(revnet.ResidualFn, module=MODULE)
Downsample = gin.external_configurable(revnet.Downsample, module=MODULE)
ClassifierHead = gin.external_configurable(revnet.ClassifierHead, module=MODULE)
