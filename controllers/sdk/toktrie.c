/* AICI's serialized token trie (blob 100), the mask walker, and StackRecognizer. */
#include "aici.h"

#define TRIE_MAGIC 0x558b6fd3u
#define NO_TOKEN 0xFFFFFFu

typedef struct { uint32_t bits, bits2; } trie_node;   /* token<<8|byte, subtree_size<<8|num_parents */

static uint8_t *trie_blob;
static const trie_node *nodes;
static uint32_t n_nodes, trie_vocab;
static const uint32_t *tok_offsets;
static const uint8_t *tok_data;
static uint32_t tok_data_len;

static void trie_load(void) {
    if (trie_blob) return;
    uint32_t n;
    trie_blob = aici_read_blob(aici_host_token_trie(), &n);
    const uint32_t *h = (const uint32_t *)trie_blob;
    if (n < 28 || h[0] != TRIE_MAGIC || h[1] < 28 || h[1] + h[2] + h[3] > n) {
        aici_logs("aici sdk: bad token trie blob\n");
        aici_host_stop();
    }
    nodes = (const trie_node *)(trie_blob + h[1]);
    n_nodes = h[2] / 8;
    trie_vocab = h[3] / 4;
    tok_offsets = (const uint32_t *)(trie_blob + h[1] + h[2]);
    tok_data = trie_blob + h[1] + h[2] + h[3];
    tok_data_len = n - h[1] - h[2] - h[3];
}

const uint8_t *aici_token_bytes(uint32_t tok, uint32_t *len) {
    trie_load();
    *len = 0;
    if (tok >= trie_vocab) return NULL;
    uint32_t off = tok_offsets[tok] >> 10, l = tok_offsets[tok] & 1023;
    if (off + l > tok_data_len) return NULL;
    *len = l;
    return tok_data + off;
}

void aici_detokenize(aici_buf *b, const uint32_t *toks, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t l;
        const uint8_t *p = aici_token_bytes(toks[i], &l);
        if (l) aici_buf_put(b, p, l);
    }
}

uint32_t *aici_mask_new(void) { return calloc(aici_vocab_words(), 4); }

void aici_mask_allow_all(uint32_t *m) {
    uint32_t v = aici_vocab_size(), w = aici_vocab_words();
    memset(m, 0xFF, w * 4);
    if (v & 31) m[w - 1] = (1u << (v & 31)) - 1;
}

void aici_compute_mask(aici_recognizer *r, uint32_t *mask) {
    trie_load();
    uint32_t vocab = aici_vocab_size();
    uint32_t eos = aici_eos();
    if (eos < vocab && r->vt->special_allowed(r, eos)) aici_mask_allow(mask, eos);
    uint32_t endp = n_nodes ? nodes[0].bits2 >> 8 : 0;
    if (endp > n_nodes) endp = n_nodes;
    uint32_t p = 1, next_pop = 0;
    while (p < endp) {
        r->vt->pop_bytes(r, next_pop);
        const trie_node *nd = &nodes[p];
        uint32_t size = nd->bits2 >> 8;
        if (r->vt->try_push_byte(r, (uint8_t)nd->bits)) {
            uint32_t tok = nd->bits >> 8;
            if (tok != NO_TOKEN && tok < vocab) aici_mask_allow(mask, tok);
            next_pop = size == 1 ? (nd->bits2 & 0xFF) : 0;
            p++;
        } else {
            p += size ? size : 1;
            next_pop = (nd->bits2 & 0xFF) - 1;
        }
    }
    r->vt->trie_finished(r);
}

int aici_recognizer_push_token(aici_recognizer *r, uint32_t tok) {
    uint32_t l;
    const uint8_t *p = aici_token_bytes(tok, &l);
    for (uint32_t i = 0; i < l; i++) {
        if (!r->vt->try_push_byte(r, p[i])) {
            r->vt->pop_bytes(r, i);
            return 0;
        }
    }
    r->vt->collapse(r);
    return 1;
}

/* ---------- StackRecognizer ---------- */
static void sr_pop(aici_recognizer *r, uint32_t n) {
    aici_stack_recognizer *s = (aici_stack_recognizer *)r;
    s->sp = n > s->sp ? 0 : s->sp - n;
}
static int sr_try_push(aici_recognizer *r, uint8_t b) {
    aici_stack_recognizer *s = (aici_stack_recognizer *)r;
    uint32_t next;
    if (s->sp + 1 >= AICI_STACK_DEPTH) return 0;
    if (!s->f->append(s->f, s->stack[s->sp], b, &next)) return 0;
    s->stack[++s->sp] = next;
    return 1;
}
static int sr_special(aici_recognizer *r, uint32_t tok) {
    aici_stack_recognizer *s = (aici_stack_recognizer *)r;
    return s->f->special_allowed(s->f, s->stack[s->sp], tok);
}
static void sr_collapse(aici_recognizer *r) {
    aici_stack_recognizer *s = (aici_stack_recognizer *)r;
    s->stack[0] = s->stack[s->sp];
    s->sp = 0;
}
static void sr_finished(aici_recognizer *r) { ((aici_stack_recognizer *)r)->sp = 0; }

static const aici_recognizer_vt stack_vt = {sr_pop, sr_try_push, sr_special, sr_collapse, sr_finished};

void aici_stack_recognizer_init(aici_stack_recognizer *s, aici_functional *f) {
    s->base.vt = &stack_vt;
    s->f = f;
    s->sp = 0;
    s->stack[0] = f->initial(f);
}
