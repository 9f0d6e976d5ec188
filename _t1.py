import copy, torch
from examples.swin3d import import_torchvision, parallelize
import_torchvision()
from torchvision.models.video import swin3d_t
torch.manual_seed(0)
ref = swin3d_t(weights=None).double().eval()
model = parallelize(copy.deepcopy(ref))
for shape in [(2,3,4,32,32), (1,3,8,56,56), (2,3,4,36,44)]:
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        a = ref(x); b = model(x)
    print(shape, (a-b).abs().max().item(), a.abs().max().item())
