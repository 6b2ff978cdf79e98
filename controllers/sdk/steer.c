/* Activation steering and concept readouts (ABI.md "Steering and readouts"). */
#include "aici.h"

int32_t aici_steer_concept(const char *name, double scale) {
    if (scale == 0) return aici_steer("[]", 2);
    aici_buf vector = {0}, b = {0};
    aici_buf_puts(&vector, "concept:");
    aici_buf_puts(&vector, name);
    aici_buf_puts(&b, "[{\"vector\":");
    aici_json_put_str(&b, vector.p, vector.n);
    aici_buf_puts(&b, ",\"scale\":");
    aici_buf_f64(&b, scale);
    aici_buf_puts(&b, "}]");
    int32_t r = aici_steer(b.p, b.n);
    aici_buf_free(&vector);
    aici_buf_free(&b);
    return r;
}

int32_t aici_readout_concept(const char *name, uint32_t *n_layers, uint32_t *n_concepts) {
    char small[512];
    int32_t n = tiller_readout_info(small, sizeof small);
    if (n < 0) return -1;
    char *text = (uint32_t)n <= sizeof small ? small : malloc((uint32_t)n);
    if (text != small) tiller_readout_info(text, (uint32_t)n);
    aici_json info, concepts, layers, item;
    int32_t found = -1;
    if (aici_json_parse(text, (uint32_t)n, &info) && aici_json_get(info, "concepts", &concepts) &&
        aici_json_get(info, "layers", &layers)) {
        *n_layers = aici_json_len(layers);
        *n_concepts = aici_json_len(concepts);
        aici_json_iter it = {0};
        for (int32_t i = 0; found < 0 && aici_json_next(concepts, &it, NULL, &item); i++)
            if (aici_json_str_eq(item, name)) found = i;
    }
    if (found < 0) {
        aici_logs("readout error: no concept \"");
        aici_logs(name);
        aici_logs("\" among ");
        aici_log(text, (uint32_t)n);
        aici_logs("\n");
    }
    if (text != small) free(text);
    return found;
}
